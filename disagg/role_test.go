package disagg

import (
	"encoding/json"
	"errors"
	"testing"
)

func TestParseRole(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want Role
		ok   bool
	}{
		{"prefill", RolePrefill, true},
		{"decode", RoleDecode, true},
		{"unified", RoleUnified, true},
		{"", RoleUnified, true},
		{" Decode ", RoleDecode, true},
		{"PREFILL", RolePrefill, true},
		{"both", 0, false},
		{"kv_producer", 0, false},
	} {
		got, err := ParseRole(tt.in)
		if tt.ok != (err == nil) || (tt.ok && got != tt.want) {
			t.Errorf("ParseRole(%q) = %v, %v; want %v (ok %v)", tt.in, got, err, tt.want, tt.ok)
		}
		if err != nil && !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("ParseRole(%q) error %v does not wrap ErrInvalidConfig", tt.in, err)
		}
	}
}

func TestRoleText(t *testing.T) {
	type backend struct {
		Role Role `json:"role"`
	}
	for _, r := range []Role{RoleUnified, RolePrefill, RoleDecode} {
		b, err := json.Marshal(backend{r})
		if err != nil {
			t.Fatal(err)
		}
		var back backend
		if err := json.Unmarshal(b, &back); err != nil || back.Role != r {
			t.Errorf("round trip of %v: %s → %v, %v", r, b, back.Role, err)
		}
	}
	if _, err := Role(7).MarshalText(); err == nil {
		t.Error("invalid role marshalled")
	}
	var r Role
	if err := json.Unmarshal([]byte(`{"role":"decoder"}`), &struct {
		Role *Role `json:"role"`
	}{&r}); err == nil {
		t.Error("unknown role unmarshalled")
	}
}

func TestPathAndReasonLabels(t *testing.T) {
	want := map[Path]string{PathFastDecode: "fast_decode", PathPrefillThenDecode: "prefill_then_decode",
		PathUnified: "unified", PathFallback: "fallback"}
	for _, p := range Paths() {
		if p.String() != want[p] {
			t.Errorf("%d.String() = %q, want %q", p, p.String(), want[p])
		}
		back, err := ParsePath(p.String())
		if err != nil || back != p {
			t.Errorf("ParsePath(%q) = %v, %v", p.String(), back, err)
		}
		if b, _ := p.MarshalText(); string(b) != want[p] {
			t.Errorf("MarshalText = %s", b)
		}
	}
	if _, err := ParsePath("storage"); err == nil {
		t.Error("ParsePath accepted an unknown label")
	}
	seen := map[string]bool{}
	for _, r := range Reasons() {
		s := r.String()
		if s == "" || seen[s] {
			t.Errorf("reason %d has label %q (empty or duplicate)", r, s)
		}
		seen[s] = true
	}
	if len(Reasons()) != int(numReasons)-1 || len(Paths()) != int(numPaths)-1 {
		t.Error("Paths or Reasons misses a constant")
	}
}
