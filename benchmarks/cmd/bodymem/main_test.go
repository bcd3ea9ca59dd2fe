package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvroute/kvroute/internal/testenv"
)

// TestRunTiny runs the whole measurement in a tiny configuration: build, child, burst, report.
func TestRunTiny(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the proxy")
	}
	testenv.SkipUnlessLong(t, "builds the proxy with a nested go build (over a minute from a cold build cache) and measures its peak RSS")
	if runtime.GOOS != "linux" {
		t.Skip("peak RSS is read from /proc")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := config{n: 3, size: 64 << 10, heapProfile: filepath.Join(t.TempDir(), "heap.pb.gz"), goMemLimit: "256MiB"}
	r, err := run(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if r.statuses[200] != c.n {
		t.Fatalf("statuses %v (errors %v), want %d × 200", r.statuses, r.errs, c.n)
	}
	if r.idleHWM <= 0 || r.peakHWM < r.idleHWM {
		t.Fatalf("VmHWM %d before, %d after", r.idleHWM, r.peakHWM)
	}
	if fi, err := os.Stat(c.heapProfile); err != nil || fi.Size() == 0 || r.heapSamples == 0 || r.heapInuse == 0 {
		t.Fatalf("heap profile %v (%v), %d samples, HeapInuse %d", fi, err, r.heapSamples, r.heapInuse)
	}
	var out bytes.Buffer
	r.commandLine = "go run ./benchmarks/cmd/bodymem -n 3 -size 65536"
	report(&out, c, r)
	for _, want := range []string{"go version", "| 200 | 3 |", "after the burst (peak)", "CPU:", "Largest HeapInuse", "GOMEMLIMIT: 256MiB"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, out.String())
		}
	}
}

// The bodies are valid chat requests of about the size asked for; plain ones hold no escape.
func TestChatBody(t *testing.T) {
	for _, size := range []int{300, 4 << 10, 200 << 10} {
		b := chatBody(1, size, size == 4<<10)
		var v struct {
			Model    string
			Messages []struct{ Role, Content string }
		}
		if err := json.Unmarshal(b, &v); err != nil {
			t.Fatalf("size %d: %v", size, err)
		}
		if len(b) > size || len(b) < size-256 || len(v.Messages) < 2 {
			t.Errorf("size %d: got %d bytes, %d messages", size, len(b), len(v.Messages))
		}
		if plain := size == 4<<10; plain == bytes.Contains(b, []byte{'\\'}) {
			t.Errorf("size %d: plain %v, body holds a backslash: %v", size, plain, !plain)
		}
	}
}
