package stack_test

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/kvroute/kvroute/stack"
)

// NewLogger writes text or JSON at the level given, which may change while it logs; any other
// format is an error naming the flag.
func TestNewLogger(t *testing.T) {
	var buf bytes.Buffer
	level := new(slog.LevelVar)
	log, err := stack.NewLogger(&buf, "json", level)
	if err != nil {
		t.Fatal(err)
	}
	log.Debug("hidden")
	level.Set(slog.LevelDebug)
	log.Debug("shown", "k", 1)
	if got := buf.String(); strings.Contains(got, "hidden") || !strings.Contains(got, `"msg":"shown","k":1`) {
		t.Errorf("json log: %q", got)
	}
	buf.Reset()
	if log, err = stack.NewLogger(&buf, "text", slog.LevelInfo); err != nil {
		t.Fatal(err)
	}
	log.Info("hello")
	if !strings.Contains(buf.String(), "msg=hello") {
		t.Errorf("text log: %q", buf.String())
	}
	if _, err := stack.NewLogger(&buf, "xml", slog.LevelInfo); err == nil || !strings.Contains(err.Error(), "-log-format") {
		t.Errorf("xml: %v", err)
	}
}
