package disagg

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
)

// Credentials must not leave an ExternalStorage by any of the ways a value gets printed, logged
// or marshalled, alone or inside a Config or a Plan.
func TestStorageRedaction(t *testing.T) {
	const cred, ak, sk = "cred-Zq81x", "AKIA-Pq77", "secret-Mn42w"
	s := ExternalStorage{Endpoint: "http://kv-store:8080", Namespace: "inference/kv-cache",
		Credentials: cred, AccessKey: ak, SecretKey: sk}
	cfg := Config{DefaultStorage: s}
	plan := Plan{Path: PathPrefillThenDecode, Prefill: "p1", Decode: "d1", Storage: s}

	var slogText, slogJSON bytes.Buffer
	slog.New(slog.NewTextHandler(&slogText, nil)).Info("storage", "s", s, "plan", plan)
	slog.New(slog.NewJSONHandler(&slogJSON, nil)).Info("storage", "s", s, "p", &s)
	outputs := map[string]string{
		"String": s.String(),
		"%v":     fmt.Sprintf("%v", s),
		"%+v":    fmt.Sprintf("%+v", s),
		"%#v":    fmt.Sprintf("%#v", s),
		//lint:ignore S1025 the test checks what fmt prints for a pointer
		"%s ptr":    fmt.Sprintf("%s", &s),
		"%q":        fmt.Sprintf("%q", s),
		"config":    fmt.Sprintf("%+v", cfg),
		"plan":      fmt.Sprintf("%+v", plan),
		"plan %#v":  fmt.Sprintf("%#v", plan),
		"slog text": slogText.String(),
		"slog json": slogJSON.String(),
	}
	for _, v := range []any{s, &s, plan, cfg} {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		outputs[fmt.Sprintf("json %T", v)] = string(b)
	}
	for name, out := range outputs {
		for _, secret := range []string{cred, ak, sk} {
			if strings.Contains(out, secret) {
				t.Errorf("%s leaks a credential: %s", name, out)
			}
		}
		if !strings.Contains(out, "kv-store") {
			t.Errorf("%s lost the endpoint: %s", name, out)
		}
		if !strings.Contains(out, Redacted) && name != "config" {
			t.Errorf("%s does not show that credentials are set: %s", name, out)
		}
	}
	// The value itself keeps them for the code that connects.
	if s.Credentials != cred || s.AccessKey != ak || s.SecretKey != sk {
		t.Error("redaction modified the value")
	}
	var round map[string]string
	b, _ := json.Marshal(s)
	if err := json.Unmarshal(b, &round); err != nil {
		t.Fatal(err)
	}
	if round["endpoint"] != s.Endpoint || round["kv_namespace"] != s.Namespace || round["secret_key"] != Redacted {
		t.Errorf("json = %s", b)
	}
	// Unset credentials stay visibly unset.
	empty := ExternalStorage{Endpoint: "http://kv-store:8080"}
	if strings.Contains(empty.String(), Redacted) {
		t.Errorf("String of storage without credentials = %q", empty.String())
	}
}

func TestSameLocation(t *testing.T) {
	a := ExternalStorage{Endpoint: "http://s:8080", Namespace: "kv/cache", SecretKey: "x"}
	for _, tt := range []struct {
		b    ExternalStorage
		want bool
	}{
		{ExternalStorage{Endpoint: "http://s:8080", Namespace: "kv/cache"}, true},
		{ExternalStorage{Endpoint: "http://s:8080/", Namespace: "/kv/cache/", SecretKey: "other"}, true},
		{ExternalStorage{Endpoint: "http://s:8080", Namespace: "kv/other"}, false},
		{ExternalStorage{Endpoint: "http://t:8080", Namespace: "kv/cache"}, false},
		{ExternalStorage{}, false},
	} {
		if got := a.SameLocation(tt.b); got != tt.want {
			t.Errorf("SameLocation(%v) = %v, want %v", tt.b, got, tt.want)
		}
	}
	if !(ExternalStorage{}).SameLocation(ExternalStorage{}) || !(ExternalStorage{}).IsZero() || a.IsZero() {
		t.Error("zero locations")
	}
}
