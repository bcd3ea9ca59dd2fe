// Package benchenv holds what kvroute's benchmark commands share about the machine and the
// checkout they run in: the module's root, the proxy and other commands built from it, and the
// CPU's name for the report.
package benchenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
)

var moduleLine = regexp.MustCompile(`(?m)^module\s+github\.com/kvroute/kvroute\s*$`)

// ModuleRoot returns the kvroute module's root: repo when set, else the nearest directory at or
// above the working directory's module (go env GOMOD; the benchmarks module sits inside the
// library's) whose go.mod is github.com/kvroute/kvroute's.
func ModuleRoot(ctx context.Context, repo string) (string, error) {
	if repo == "" {
		out, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
		if err != nil {
			return "", fmt.Errorf("go env GOMOD: %w", err)
		}
		gomod := strings.TrimSpace(string(out))
		if gomod == "" || gomod == os.DevNull {
			return "", errors.New("not in a Go module: run from the kvroute checkout or pass -repo")
		}
		repo = filepath.Dir(gomod)
		for dir := repo; ; dir = filepath.Dir(dir) {
			if mod, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && moduleLine.Match(mod) {
				repo = dir
				break
			}
			if filepath.Dir(dir) == dir {
				break
			}
		}
	}
	mod, err := os.ReadFile(filepath.Join(repo, "go.mod"))
	if err != nil {
		return "", fmt.Errorf("-repo: %w", err)
	}
	if !moduleLine.Match(mod) {
		return "", fmt.Errorf("%s is not the github.com/kvroute/kvroute module", repo)
	}
	return repo, nil
}

// BuildProxy builds ./examples/proxy of the module at repo into bin.
func BuildProxy(ctx context.Context, repo, bin string) error {
	return Build(ctx, repo, "./examples/proxy", bin)
}

// Build builds the command pkg (a path relative to repo, such as ./examples/enginesim) of the
// workspace at repo into bin.
func Build(ctx context.Context, repo, pkg, bin string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, pkg)
	cmd.Dir = repo
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %w\n%s", pkg, err, out)
	}
	return nil
}

// GitDescribe names the commit of the checkout at repo, "-dirty" when the working tree differs
// from it; "an unknown commit" without git.
func GitDescribe(ctx context.Context, repo string) string {
	out, err := exec.CommandContext(ctx, "git", "-C", repo, "describe", "--always", "--dirty", "--abbrev=12").Output()
	if err != nil {
		return "an unknown commit"
	}
	return "commit " + strings.TrimSpace(string(out))
}

// CPUModel returns the CPU's model name from /proc/cpuinfo, or GOARCH where there is none.
func CPUModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return runtime.GOARCH + " (no /proc/cpuinfo)"
	}
	if m := regexp.MustCompile(`(?m)^(?:model name|Model|cpu model)\s*:\s*(.+)$`).FindSubmatch(b); m != nil {
		return strings.TrimSpace(string(m[1]))
	}
	return runtime.GOARCH + " (model not in /proc/cpuinfo)"
}
