package enginesim

import (
	"context"
	"errors"
	"fmt"
)

// Demo modes of DemoConfig.Mode.
const (
	// DemoUnified is N unified engines behind every tier (the reference proxy's default demo).
	DemoUnified = "unified"
	// DemoDisagg is a prefill/decode fleet: one prefill engine, N−2 decode engines and one
	// unified engine as the fallback, exchanging KV through an in-process S3 (MemoryS3) unless
	// DemoConfig.Storage names a bucket.
	DemoDisagg = "disagg"
)

// DemoConfig configures StartDemo.
type DemoConfig struct {
	// Mode is DemoUnified ("" means it) or DemoDisagg.
	Mode string
	// Engines is the number of engines, 1 to 64 (3 to 64 for DemoDisagg); 0 means 4.
	Engines int
	// SpeedFactor is every engine's Latency.SpeedFactor (0: no simulated latency).
	SpeedFactor float64
	// Storage is the KV transit store of DemoDisagg; nil means a MemoryS3 of the Demo's own.
	Storage *StorageConfig
}

// Demo is a fleet of simulated engines started for the reference proxy's demo modes. Its methods are safe for concurrent use; Close stops the
// engines and the in-process S3, and is idempotent.
type Demo struct {
	fleets  []*Fleet
	s3      *MemoryS3      // nil unless DemoDisagg without Storage
	storage *StorageConfig // the disaggregated fleet's KV transit store; nil for DemoUnified
}

// StartDemo starts the engines of cfg's mode on free loopback ports (block size 16, 2,048 blocks
// of KV cache each, KV events over ZMQ with replay). The engines of DemoDisagg are named
// prefill-0, decode-0…, unified-0; those of DemoUnified enginesim-0…. On error whatever was
// started is closed; the error wraps ErrInvalidConfig for a bad cfg. ctx bounds the binds.
func StartDemo(ctx context.Context, cfg DemoConfig) (*Demo, error) {
	n := cfg.Engines
	if n == 0 {
		n = 4
	}
	type group struct {
		name string
		n    int
		role Role
	}
	groups := []group{{"enginesim", n, RoleUnified}}
	switch {
	case n < 1 || n > 64:
		return nil, fmt.Errorf("%w: %d engines: want 1 to 64", ErrInvalidConfig, n)
	case cfg.Mode == DemoDisagg && n < 3:
		return nil, fmt.Errorf("%w: %d engines: disaggregation needs 3 to 64 (prefill, decode, unified)", ErrInvalidConfig, n)
	case cfg.Mode == DemoDisagg:
		groups = []group{{"prefill", 1, RolePrefill}, {"decode", n - 2, RoleDecode}, {"unified", 1, RoleUnified}}
	case cfg.Mode != "" && cfg.Mode != DemoUnified:
		return nil, fmt.Errorf("%w: demo mode %q: want %s or %s", ErrInvalidConfig, cfg.Mode, DemoUnified, DemoDisagg)
	}
	d := &Demo{}
	var storage *StorageConfig // nil: unified engines, no disaggregation
	if cfg.Mode == DemoDisagg {
		storage = cfg.Storage
	}
	if cfg.Mode == DemoDisagg && storage == nil {
		s3, err := StartMemoryS3(ctx, "")
		if err != nil {
			return nil, err
		}
		d.s3 = s3
		storage = &StorageConfig{Endpoint: s3.Endpoint(), Bucket: "kv-cache"}
	}
	for _, g := range groups {
		base := Config{Name: g.name, BlockSize: 16, CapacityBlocks: 2048, Latency: Latency{SpeedFactor: cfg.SpeedFactor},
			Storage: storage}
		roles := make([]Role, g.n)
		for i := range roles {
			roles[i] = g.role
		}
		f, err := StartFleet(ctx, FleetConfig{N: g.n, ZMQ: true, Roles: roles, Base: base})
		if err != nil {
			return nil, errors.Join(err, d.Close())
		}
		d.fleets = append(d.fleets, f)
	}
	d.storage = storage
	return d, nil
}

// Info returns where each engine is reachable, in order.
func (d *Demo) Info() []EngineInfo {
	var out []EngineInfo
	for _, f := range d.fleets {
		out = append(out, f.Info()...)
	}
	return out
}

// Engines returns the engines, in order.
func (d *Demo) Engines() []*Engine {
	var out []*Engine
	for _, f := range d.fleets {
		out = append(out, f.Engines()...)
	}
	return out
}

// Storage returns the KV transit store of a DemoDisagg fleet (the in-process S3's when
// DemoConfig.Storage was nil), nil for DemoUnified.
func (d *Demo) Storage() *StorageConfig { return d.storage }

// Close stops the engines, then the in-process S3.
func (d *Demo) Close() error {
	var errs []error
	for _, f := range d.fleets {
		errs = append(errs, f.Close())
	}
	if d.s3 != nil {
		errs = append(errs, d.s3.Close())
	}
	return errors.Join(errs...)
}

// StorageFromEnv returns the S3 bucket that getenv's S3_ENDPOINT and S3_BUCKET name, with
// S3_ACCESS_KEY and S3_SECRET_KEY, as DemoConfig.Storage; nil when either is unset (DemoDisagg
// then uses a MemoryS3). The variables are those of the example configurations.
func StorageFromEnv(getenv func(string) string) *StorageConfig {
	ep, bucket := getenv("S3_ENDPOINT"), getenv("S3_BUCKET")
	if ep == "" || bucket == "" {
		return nil
	}
	return &StorageConfig{Endpoint: ep, Bucket: bucket, AccessKey: getenv("S3_ACCESS_KEY"), SecretKey: getenv("S3_SECRET_KEY")}
}
