package storeutil

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
)

func TestRedact(t *testing.T) {
	err := Redact(fmt.Errorf("auth user:%s failed: %w", "p4ss", io.EOF), Secrets("p4ss", ""))
	if strings.Contains(err.Error(), "p4ss") || !strings.Contains(err.Error(), "[REDACTED]") {
		t.Errorf("Redact: %q", err)
	}
	if !errors.Is(err, io.EOF) {
		t.Error("Redact lost the wrapped error")
	}
	if Redact(nil, Secrets("x")) != nil {
		t.Error("Redact(nil) != nil")
	}
}
