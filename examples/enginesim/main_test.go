package main

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/internal/enginesim"
)

func TestParseFlagsDisaggregation(t *testing.T) {
	env := map[string]string{"AWS_ACCESS_KEY_ID": "env-access", "AWS_SECRET_ACCESS_KEY": "env-secret"}
	getenv := func(k string) string { return env[k] }
	s3 := []string{"-s3-endpoint", "http://127.0.0.1:7070", "-s3-bucket", "kv"}
	tests := []struct {
		name    string
		args    []string
		role    enginesim.Role
		storage *enginesim.StorageConfig // nil: none
		err     string
	}{
		{name: "defaults", args: nil, role: enginesim.RoleUnified},
		{name: "decode without storage", args: []string{"-role", "decode"}, role: enginesim.RoleDecode},
		{name: "prefill with storage, credentials from the environment",
			args: append([]string{"-role", "prefill"}, s3...), role: enginesim.RolePrefill,
			storage: &enginesim.StorageConfig{Endpoint: "http://127.0.0.1:7070", Bucket: "kv", Namespace: enginesim.DefaultKVNamespace,
				Region: enginesim.DefaultStorageRegion, AccessKey: "env-access", SecretKey: "env-secret",
				BytesPerToken: enginesim.DefaultBytesPerToken, BandwidthBytesPerSec: enginesim.DefaultStorageBandwidth}},
		{name: "flags win over the environment, every storage flag",
			args: append([]string{"-role", "decode", "-s3-access-key", "flag-access", "-s3-secret-key", "flag-secret",
				"-kv-namespace", "team/kv", "-s3-region", "eu-west-1", "-kv-bytes-per-token", "320000",
				"-storage-bandwidth", "5e9", "-storage-lookup", "off"}, s3...), role: enginesim.RoleDecode,
			storage: &enginesim.StorageConfig{Endpoint: "http://127.0.0.1:7070", Bucket: "kv", Namespace: "team/kv",
				Region: "eu-west-1", AccessKey: "flag-access", SecretKey: "flag-secret", BytesPerToken: 320000,
				BandwidthBytesPerSec: 5e9, Lookup: enginesim.StorageLookupOff}},
		{name: "bad role", args: []string{"-role", "both"}, err: "role"},
		{name: "bad lookup", args: []string{"-storage-lookup", "maybe"}, err: "storage lookup"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, _, err := parseFlags(tt.args, getenv)
			if tt.err != "" {
				assert.ErrorContains(t, err, tt.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.role, cfg.Role)
			assert.Equal(t, tt.storage, cfg.Storage)
			if cfg.Storage != nil {
				printed := fmt.Sprint(cfg.Storage) + fmt.Sprintf("%+v", cfg)
				assert.NotContains(t, printed, cfg.Storage.SecretKey)
				assert.NotContains(t, printed, cfg.Storage.AccessKey)
				e, err := enginesim.New(cfg)
				require.NoError(t, err, "the flags make a valid engine")
				require.NoError(t, e.Close())
			}
		})
	}
}
