package stack

import (
	"fmt"
	"io"
	"log/slog"
)

// NewLogger returns the logger of a kvroute command: format "text" or "json" (the -log-format
// flag), writing to w, at level (a *slog.LevelVar lets -v or log_level change it live).
func NewLogger(w io.Writer, format string, level slog.Leveler) (*slog.Logger, error) {
	opts := &slog.HandlerOptions{Level: level}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("-log-format %q: want text or json", format)
}
