package telemetry

import (
	"go/ast"
	"go/parser"
	"go/token"
	"strconv"
	"strings"
	"testing"
)

// Every name is declared once, with a value no other name has, under kvroute's prefixes: two
// instruments of one name would be merged or refused by an OpenTelemetry SDK.
func TestNamesAreUnique(t *testing.T) {
	f, err := parser.ParseFile(token.NewFileSet(), "telemetry.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]string{}
	n := 0
	for _, decl := range f.Decls {
		gd, ok := decl.(*ast.GenDecl)
		if !ok || gd.Tok != token.CONST {
			continue
		}
		for _, spec := range gd.Specs {
			vs := spec.(*ast.ValueSpec)
			for i, name := range vs.Names {
				v, err := strconv.Unquote(vs.Values[i].(*ast.BasicLit).Value)
				if err != nil {
					t.Fatalf("%s: %v", name.Name, err)
				}
				if other, dup := seen[v]; dup {
					t.Errorf("%s and %s are both %q", other, name.Name, v)
				}
				seen[v] = name.Name
				if !strings.HasPrefix(v, "kvroute.") && !strings.HasPrefix(v, "respcache.") {
					t.Errorf("%s = %q: not under kvroute's prefixes", name.Name, v)
				}
				if !strings.HasPrefix(name.Name, "Metric") && !strings.HasPrefix(name.Name, "Span") && !strings.HasPrefix(name.Name, "Attr") {
					t.Errorf("%s: names start with Metric, Span or Attr", name.Name)
				}
				n++
			}
		}
	}
	if n < 60 {
		t.Fatalf("found %d names; the parser missed some", n)
	}
}
