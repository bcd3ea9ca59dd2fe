// Package apigolden holds the test that keeps the core module's exported API in a checked-in
// file, api/kvroute.txt, so that every change of the API shows in review: a change to an exported
// identifier fails this test until the file is regenerated in the same commit with
//
//	go test ./internal/apigolden -update
package apigolden

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"go/importer"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite api/kvroute.txt from the code")

const module = "github.com/kvroute/kvroute"

// goldenPath is the checked-in listing, relative to this package's directory.
var goldenPath = filepath.Join("..", "..", "api", "kvroute.txt")

// listed is what "go list -export -json" reports of one package.
type listed struct {
	ImportPath string
	Export     string
	Standard   bool
	Module     *struct{ Path string }
}

func TestExportedAPI(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the API listing compiles every package of the module")
	}
	got, err := apiListing()
	if err != nil {
		t.Fatal(err)
	}
	if *update {
		if err := os.WriteFile(goldenPath, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(goldenPath)
	if err != nil {
		t.Fatalf("%v: run go test ./internal/apigolden -update to create it", err)
	}
	if added, removed := diffLines(string(want), got); len(added)+len(removed) > 0 {
		var b strings.Builder
		for _, l := range removed {
			fmt.Fprintf(&b, "- %s\n", l)
		}
		for _, l := range added {
			fmt.Fprintf(&b, "+ %s\n", l)
		}
		t.Errorf("the exported API differs from api/kvroute.txt (- recorded, + in the code):\n%s\n"+
			"If the change is meant, run go test ./internal/apigolden -update, commit api/kvroute.txt "+
			"with the change and list it in CHANGELOG.md.", b.String())
	}
}

// TestDiffLines checks the comparison the API test relies on.
func TestDiffLines(t *testing.T) {
	added, removed := diffLines("a\nb\nc\n", "a\nc\nd\n")
	if !slices.Equal(added, []string{"d"}) || !slices.Equal(removed, []string{"b"}) {
		t.Fatalf("added %q removed %q", added, removed)
	}
	if a, r := diffLines("x\n", "x\n"); len(a)+len(r) != 0 {
		t.Fatalf("equal inputs differ: %q %q", a, r)
	}
}

// diffLines returns the lines only in got (added) and only in want (removed).
func diffLines(want, got string) (added, removed []string) {
	set := func(s string) map[string]bool {
		m := map[string]bool{}
		for _, l := range strings.Split(s, "\n") {
			if l != "" {
				m[l] = true
			}
		}
		return m
	}
	w, g := set(want), set(got)
	for l := range g {
		if !w[l] {
			added = append(added, l)
		}
	}
	for l := range w {
		if !g[l] {
			removed = append(removed, l)
		}
	}
	slices.Sort(added)
	slices.Sort(removed)
	return added, removed
}

// apiListing compiles the module's packages (outside a workspace, as an importer builds them)
// and lists the exported API of every package an importer can reach (not internal ones).
func apiListing() (string, error) {
	cmd := exec.Command("go", "list", "-export", "-deps", "-json=ImportPath,Export,Standard,Module", "./...")
	cmd.Dir = filepath.Join("..", "..")
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOOS=linux", "GOARCH=amd64", "CGO_ENABLED=0")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go list: %v\n%s", err, stderr.String())
	}
	exports := map[string]string{}
	var ours []string
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p listed
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return "", err
		}
		exports[p.ImportPath] = p.Export
		if p.Module != nil && p.Module.Path == module && !isInternal(p.ImportPath) {
			ours = append(ours, p.ImportPath)
		}
	}
	fset := token.NewFileSet()
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		f, ok := exports[path]
		if !ok || f == "" {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(f)
	})
	slices.Sort(ours)
	var lines []string
	for _, path := range ours {
		pkg, err := imp.Import(path)
		if err != nil {
			return "", fmt.Errorf("import %s: %w", path, err)
		}
		lines = append(lines, packageLines(pkg)...)
	}
	slices.Sort(lines)
	lines = slices.Compact(lines)
	return strings.Join(lines, "\n") + "\n", nil
}

func isInternal(path string) bool {
	return strings.HasSuffix(path, "/internal") || strings.Contains(path, "/internal/")
}

// packageLines lists one package's exported identifiers, one line each, in the form
// "pkg PATH, KIND NAME DETAILS"; a struct's exported fields and a type's exported methods get a
// line of their own, so that adding a field shows as one added line.
func packageLines(pkg *types.Package) []string {
	qual := func(p *types.Package) string {
		if p == pkg {
			return ""
		}
		return p.Name()
	}
	typ := func(t types.Type) string { return types.TypeString(t, qual) }
	prefix := "pkg " + pkg.Path() + ", "
	var out []string
	add := func(format string, args ...any) { out = append(out, prefix+fmt.Sprintf(format, args...)) }
	scope := pkg.Scope()
	for _, name := range scope.Names() {
		obj := scope.Lookup(name)
		if !obj.Exported() {
			continue
		}
		switch o := obj.(type) {
		case *types.Const:
			add("const %s %s = %s", name, typ(o.Type()), o.Val().ExactString())
		case *types.Var:
			add("var %s %s", name, typ(o.Type()))
		case *types.Func:
			add("func %s%s", name, strings.TrimPrefix(typ(o.Type()), "func"))
		case *types.TypeName:
			out = append(out, typeLines(prefix, o, typ)...)
		}
	}
	return out
}

func typeLines(prefix string, o *types.TypeName, typ func(types.Type) string) []string {
	name := o.Name()
	var out []string
	add := func(format string, args ...any) { out = append(out, prefix+fmt.Sprintf(format, args...)) }
	if o.IsAlias() {
		add("type %s = %s", name, typ(types.Unalias(o.Type())))
		return out
	}
	named, _ := o.Type().(*types.Named)
	tparams := ""
	if named != nil && named.TypeParams().Len() > 0 {
		var ps []string
		for i := range named.TypeParams().Len() {
			tp := named.TypeParams().At(i)
			ps = append(ps, tp.Obj().Name()+" "+typ(tp.Constraint()))
		}
		tparams = "[" + strings.Join(ps, ", ") + "]"
	}
	switch u := o.Type().Underlying().(type) {
	case *types.Struct:
		add("type %s%s struct", name, tparams)
		for i := range u.NumFields() {
			f := u.Field(i)
			switch {
			case f.Embedded():
				add("type %s struct, embedded %s", name, typ(f.Type()))
			case f.Exported():
				add("type %s struct, %s %s", name, f.Name(), typ(f.Type()))
			}
		}
	case *types.Interface:
		add("type %s%s interface", name, tparams)
		for i := range u.NumEmbeddeds() {
			add("type %s interface, embedded %s", name, typ(u.EmbeddedType(i)))
		}
		for i := range u.NumExplicitMethods() {
			m := u.ExplicitMethod(i)
			add("type %s interface, %s%s", name, m.Name(), strings.TrimPrefix(typ(m.Type()), "func"))
		}
	default:
		add("type %s%s %s", name, tparams, typ(u))
	}
	if named != nil {
		for i := range named.NumMethods() {
			m := named.Method(i)
			if !m.Exported() {
				continue
			}
			sig := m.Type().(*types.Signature)
			recv := name
			if _, ptr := sig.Recv().Type().(*types.Pointer); ptr {
				recv = "*" + name
			}
			add("method (%s) %s%s", recv, m.Name(), strings.TrimPrefix(typ(sig), "func"))
		}
	}
	return out
}
