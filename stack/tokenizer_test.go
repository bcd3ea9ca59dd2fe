package stack_test

import (
	"context"
	"errors"
	"testing"

	"github.com/kvroute/kvroute/config"
	"github.com/kvroute/kvroute/internal/enginesim"
	"github.com/kvroute/kvroute/prefixkey"
	"github.com/kvroute/kvroute/stack"
)

// The engine tokenizer asks the first backend in rotation that serves the request's model, in
// configuration order, and gets the engine's own tokens; none left is ErrNoTokenizer.
func TestEngineTokenizerFirstInRotation(t *testing.T) {
	const model = "m"
	e0, e1 := startEngine(t, "e0", model), startEngine(t, "e1", model)
	cfg := parse(t, "kv_cache_index: {enabled: true, tokenizer: engine, tokenize_timeout: 5s}\n"+backendsYAML(model, e0.URL, e1.URL))
	out := map[string]bool{}
	tok, err := stack.NewEngineTokenizer(cfg, nil, func(b string) bool { return !out[b] })
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	req := &prefixkey.Request{Format: prefixkey.FormatOpenAIChat, Model: model, HasSystem: true, System: "You are terse.",
		Messages: []prefixkey.Message{{Role: "user", Text: "Hello there."}}}
	want := enginesim.ChatTokens(req, true)

	got, err := tok.Tokenize(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if !equal(got, want) {
		t.Errorf("tokens %v, want the engine's %v", got, want)
	}
	if n0, n1 := e0.calls["/tokenize"].Load(), e1.calls["/tokenize"].Load(); n0 != 1 || n1 != 0 {
		t.Errorf("/tokenize calls b0 %d, b1 %d; want b0 only (the first in rotation)", n0, n1)
	}

	out["b0"] = true
	other := *req
	other.Messages = []prefixkey.Message{{Role: "user", Text: "Something else."}}
	if _, err := tok.Tokenize(ctx, &other); err != nil {
		t.Fatal(err)
	}
	if n1 := e1.calls["/tokenize"].Load(); n1 != 1 {
		t.Errorf("b1 got %d /tokenize calls with b0 out of rotation, want 1", n1)
	}

	out["b1"] = true
	if _, err := tok.Tokenize(ctx, req); !errors.Is(err, stack.ErrNoTokenizer) {
		t.Errorf("every backend out of rotation: err %v, want ErrNoTokenizer", err)
	}
	clear(out)
	unknown := *req
	unknown.Model = "another-model"
	if _, err := tok.Tokenize(ctx, &unknown); !errors.Is(err, stack.ErrNoTokenizer) {
		t.Errorf("a model no backend serves: err %v, want ErrNoTokenizer", err)
	}
	if st := tok.Stats(); st.Calls != 2 || st.Errors != 0 {
		t.Errorf("stats %+v, want the 2 calls the backends answered", st)
	}
}

func TestNewEngineTokenizerBadInput(t *testing.T) {
	if _, err := stack.NewEngineTokenizer(nil, nil, nil); err == nil {
		t.Error("a nil configuration: no error")
	}
}

func equal(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// A pool's engines come and go: an added backend is asked after those already there, a removed
// one no longer, and one discovered under an "ip:port" name (in no configuration) serves the
// model its BackendConfig says.
func TestEngineTokenizerAddRemove(t *testing.T) {
	const model = "m"
	e0, e1 := startEngine(t, "e0", model), startEngine(t, "e1", model)
	cfg := parse(t, "kv_cache_index: {enabled: true, tokenizer: engine, tokenize_timeout: 5s}\n"+backendsYAML(model, e0.URL))
	tok, err := stack.NewEngineTokenizer(cfg, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	req := &prefixkey.Request{Format: prefixkey.FormatOpenAIChat, Model: model,
		Messages: []prefixkey.Message{{Role: "user", Text: "Hello there."}}}
	if err := tok.AddBackend(config.BackendConfig{Name: "127.0.0.9:8000", URL: e1.URL, Model: model}); err != nil {
		t.Fatal(err)
	}
	if _, err := tok.Tokenize(ctx, req); err != nil {
		t.Fatal(err)
	}
	if n0, n1 := e0.calls["/tokenize"].Load(), e1.calls["/tokenize"].Load(); n0 != 1 || n1 != 0 {
		t.Errorf("calls %d, %d: want the configured backend first", n0, n1)
	}
	if !tok.RemoveBackend("b0") || tok.RemoveBackend("b0") {
		t.Error("RemoveBackend must report the backend there once")
	}
	if _, err := tok.Tokenize(ctx, req); err != nil {
		t.Fatal(err)
	}
	if n1 := e1.calls["/tokenize"].Load(); n1 != 1 {
		t.Errorf("the added backend got %d calls after the first left, want 1", n1)
	}
	if err := tok.AddBackend(config.BackendConfig{Name: "bad", URL: "::nope"}); err == nil {
		t.Error("a bad URL was accepted")
	}
	tok.RemoveBackend("127.0.0.9:8000")
	if _, err := tok.Tokenize(ctx, req); !errors.Is(err, stack.ErrNoTokenizer) {
		t.Errorf("no backend left: %v", err)
	}
}
