package workspace

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestOtherModules runs "go test" on the packages of every other module of the workspace
// (go.work's use directives), with -race when this test runs under it and -short when it runs
// short, and fails with their output when they fail. It skips outside a workspace checkout (the
// library used as a dependency has no go.work) and when KVROUTE_SKIP_MODULE_TESTS=1 (for a CI that
// runs those modules itself).
func TestOtherModules(t *testing.T) {
	if os.Getenv("KVROUTE_SKIP_MODULE_TESTS") == "1" {
		t.Skip("KVROUTE_SKIP_MODULE_TESTS=1: the other modules are tested on their own")
	}
	out, err := exec.Command("go", "env", "GOWORK").Output()
	gowork := strings.TrimSpace(string(out))
	if err != nil || gowork == "" || gowork == "off" {
		t.Skip("not in a workspace checkout (no go.work): only the library module is tested")
	}
	root := filepath.Dir(gowork)
	var patterns []string
	for _, dir := range useDirs(t, gowork) {
		if filepath.Clean(dir) != "." {
			patterns = append(patterns, "./"+filepath.ToSlash(filepath.Clean(dir))+"/...")
		}
	}
	if len(patterns) == 0 {
		t.Skip("go.work names no module besides the library")
	}
	args := []string{"test", "-count=1"}
	if raceEnabled {
		args = append(args, "-race")
	}
	if testing.Short() {
		args = append(args, "-short")
	}
	cmd := exec.Command("go", append(args, patterns...)...)
	cmd.Dir = root
	var buf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	t.Logf("go %s (in %s)", strings.Join(cmd.Args[1:], " "), root)
	if err := cmd.Run(); err != nil {
		t.Fatalf("the workspace's other modules failed their tests (%v):\n%s", err, buf.String())
	}
	t.Log(buf.String())
}

// useDirs returns the directories of go.work's use directives, as written.
func useDirs(t *testing.T, gowork string) []string {
	t.Helper()
	f, err := os.Open(gowork)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var dirs []string
	inBlock := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if i := strings.Index(line, "//"); i >= 0 {
			line = strings.TrimSpace(line[:i])
		}
		switch {
		case line == "use (":
			inBlock = true
		case inBlock && line == ")":
			inBlock = false
		case inBlock && line != "":
			dirs = append(dirs, line)
		case strings.HasPrefix(line, "use "):
			dirs = append(dirs, strings.TrimSpace(strings.TrimPrefix(line, "use ")))
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return dirs
}
