package admin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/kvroute/kvroute/kvindex"
	"github.com/kvroute/kvroute/prefixkey"
)

// Bounds of the introspection endpoints.
const (
	// ProbeTimeout bounds the probe of one POST /admin/route/probe (the KV index's lookup and
	// the tokenizer it may call).
	ProbeTimeout = 5 * time.Second
	// DumpTimeout bounds one GET /admin/kv-index/dump: a stream cut by it ends with an error line.
	DumpTimeout = 30 * time.Second
	// MaxDumpLimit is the largest limit GET /admin/kv-index/dump accepts; without one it lists
	// kvindex.DefaultDumpLimit entries.
	MaxDumpLimit = 100_000
	// dumpFlushEvery is how many lines the dump writes between flushes.
	dumpFlushEvery = 256
)

// dumpTimeout is DumpTimeout; tests shorten it.
var dumpTimeout = DumpTimeout

// ProbeHandler returns the handler of kvroute's POST /admin/route/probe: its body is an LLM
// request body (at most maxBody bytes, 413 beyond), parsed with prefixkey.Parse in the format the
// query parameter api names — chat (OpenAI chat completions), completions (OpenAI completions) or
// messages (Anthropic messages) — or, without it, the one the request looks like: messages with
// an anthropic-version header or a top-level "system" field, completions with a top-level
// "prompt", chat otherwise. It answers 200 with probe's result as JSON (a kvroute.DefaultRouter's
// Probe: what Route would decide, changing nothing); 400 {"error": …} for another api value or a
// body that does not parse; 500 {"error": …} when probe fails. probe runs under the request's
// context bounded by ProbeTimeout. Put it behind Guard. Safe for concurrent use when probe is.
func ProbeHandler[T any](probe func(context.Context, *prefixkey.Request) (T, error), maxBody int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
		if mb, ok := errors.AsType[*http.MaxBytesError](err); ok {
			writeError(w, http.StatusRequestEntityTooLarge, "request body exceeds the limit of "+strconv.FormatInt(mb.Limit, 10)+" bytes")
			return
		} else if err != nil {
			writeError(w, http.StatusBadRequest, "cannot read the request body: "+err.Error())
			return
		}
		format, err := probeFormat(r, body)
		if err != nil {
			writeError(w, http.StatusBadRequest, err.Error())
			return
		}
		req, err := prefixkey.Parse(format, body)
		if err != nil {
			writeError(w, http.StatusBadRequest, "malformed "+format.String()+" request: "+err.Error())
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), ProbeTimeout)
		defer cancel()
		res, err := probe(ctx, req)
		if err != nil {
			writeError(w, http.StatusInternalServerError, "probe: "+err.Error())
			return
		}
		writeJSON(w, http.StatusOK, res)
	})
}

// probeFormat returns the format of a probed body: the api query parameter's, or the one the
// request looks like.
func probeFormat(r *http.Request, body []byte) (prefixkey.Format, error) {
	switch api := r.URL.Query().Get("api"); api {
	case "chat":
		return prefixkey.FormatOpenAIChat, nil
	case "completions":
		return prefixkey.FormatOpenAICompletion, nil
	case "messages":
		return prefixkey.FormatAnthropicMessages, nil
	case "":
	default:
		return 0, errors.New("api must be chat, completions or messages, not " + strconv.Quote(api))
	}
	if r.Header.Get("anthropic-version") != "" {
		return prefixkey.FormatAnthropicMessages, nil
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(body, &top); err != nil {
		return 0, errors.New("the body is not a JSON object: " + err.Error())
	}
	switch {
	case top["prompt"] != nil:
		return prefixkey.FormatOpenAICompletion, nil
	case top["system"] != nil:
		return prefixkey.FormatAnthropicMessages, nil
	}
	return prefixkey.FormatOpenAIChat, nil
}

// DumpHandler returns the handler of kvroute's GET /admin/kv-index/dump?backend=<name>&limit=<n>:
// it streams d's entries for the backend (the KV index, as a kvindex.Dumper) as JSON lines, one kvindex.DumpEntry per line (Content-Type
// application/x-ndjson), flushed every 256 lines. limit defaults to kvindex.DefaultDumpLimit and
// may not exceed MaxDumpLimit; the dump runs under the request's context bounded by DumpTimeout.
// A missing backend or a bad limit is answered 400 {"error": …}, and a dump that fails before its
// first line 500 {"error": …}; once lines have gone out, a failure (the deadline, which bounds
// the writes to a client that stops reading as well, the index)
// ends the stream with a last line {"error": …}. Put it behind Guard. Safe for concurrent use
// when d is.
func DumpHandler(d kvindex.Dumper) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		backend := q.Get("backend")
		if backend == "" {
			writeError(w, http.StatusBadRequest, "the backend query parameter is required")
			return
		}
		limit := kvindex.DefaultDumpLimit
		if s := q.Get("limit"); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < 1 || n > MaxDumpLimit {
				writeError(w, http.StatusBadRequest, "limit must be an integer from 1 to "+strconv.Itoa(MaxDumpLimit)+", not "+strconv.Quote(s))
				return
			}
			limit = n
		}
		ctx, cancel := context.WithTimeout(r.Context(), dumpTimeout)
		defer cancel()
		rc := http.NewResponseController(w)
		// The deadline bounds the writes too: a client that stops reading must not hold the
		// handler (and its buffers) past DumpTimeout. A writer without deadlines (a test
		// recorder) is let be.
		if err := rc.SetWriteDeadline(time.Now().Add(dumpTimeout)); err != nil && !errors.Is(err, http.ErrNotSupported) {
			writeError(w, http.StatusInternalServerError, "dump: "+err.Error())
			return
		}
		var line bytes.Buffer
		enc := json.NewEncoder(&line)
		n := 0
		err := d.Dump(ctx, backend, limit, func(e kvindex.DumpEntry) error {
			line.Reset()
			if err := enc.Encode(e); err != nil {
				return err
			}
			if n == 0 {
				w.Header().Set("Content-Type", "application/x-ndjson")
				w.Header().Set("Cache-Control", "no-store")
				w.WriteHeader(http.StatusOK)
			}
			if _, err := w.Write(line.Bytes()); err != nil {
				return err // the client is gone
			}
			if n++; n%dumpFlushEvery == 0 {
				return rc.Flush()
			}
			return nil
		})
		switch {
		case err != nil && n == 0:
			writeError(w, http.StatusInternalServerError, "dump: "+err.Error())
			return
		case n == 0:
			w.Header().Set("Content-Type", "application/x-ndjson")
			w.Header().Set("Cache-Control", "no-store")
			w.WriteHeader(http.StatusOK)
		case err != nil:
			line.Reset()
			_ = enc.Encode(map[string]string{"error": "dump: " + err.Error()})
			_, _ = w.Write(line.Bytes())
		}
		_ = rc.Flush()
	})
}

// writeError answers status with {"error": msg}.
func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, map[string]string{"error": msg})
}

// writeJSON answers status with v as indented JSON.
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
