package config_test

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/config"
)

// The configuration's log summary names what is on and never prints a secret.
func TestLogAttrsRedacts(t *testing.T) {
	cfg, err := config.Parse([]byte(`
admin:
  auth_token: admin-secret
response_cache:
  enabled: true
  backend: tiered
  redis:
    url: redis://user:redis-secret@127.0.0.1:6379/0
    password: pass-secret
  l1:
    type: redis
  l2:
    type: s3
    endpoint: http://127.0.0.1:9000
    bucket: b
    access_key: access-secret
    secret_key: s3-secret
backends:
  - name: a
    url: http://user:url-secret@127.0.0.1:8001
`), nil)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	log.LogAttrs(t.Context(), slog.LevelInfo, "configuration", cfg.LogAttrs()...)
	log.LogAttrs(t.Context(), slog.LevelInfo, "backend", cfg.BackendLogAttrs(&cfg.Backends[0])...)
	out := buf.String()
	for _, secret := range []string{"admin-secret", "redis-secret", "pass-secret", "access-secret", "s3-secret", "url-secret"} {
		if strings.Contains(out, secret) {
			t.Errorf("the log shows %s:\n%s", secret, out)
		}
	}
	for _, want := range []string{"admin_auth=true", "response_cache.backend=tiered", "response_cache.l2.bucket=b", "name=a"} {
		if !strings.Contains(out, want) {
			t.Errorf("the log lacks %s:\n%s", want, out)
		}
	}
}
