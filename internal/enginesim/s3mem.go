package enginesim

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"encoding/xml"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// MemoryS3 is an S3-compatible object server in memory, on a loopback HTTP listener: the KV
// transit store of a prefill/decode fleet in one process (the reference proxy's -demo disagg),
// which the engines' S3 client reaches as any bucket (StorageConfig.Endpoint = Endpoint()). It
// serves what the engines use, path-style and anonymous: PUT, GET and HEAD of an object (404
// NoSuchKey when absent) and HEAD of a bucket; every bucket exists. Objects of at most 1 MiB are
// kept until Close. Its methods are safe for concurrent use; serving runs on goroutines of its own
// until Close, which is idempotent.
type MemoryS3 struct {
	srv  *http.Server
	addr string
	done chan struct{}

	mu      sync.RWMutex
	objects map[string]memObject // "bucket/key"
	closed  sync.Once
}

type memObject struct {
	data     []byte
	etag     string
	modified time.Time
}

// maxMemObject bounds an object (the engines' block objects are a few KiB).
const maxMemObject = 1 << 20

// StartMemoryS3 starts a MemoryS3 on a free port of host ("" means 127.0.0.1). ctx bounds the
// listen.
func StartMemoryS3(ctx context.Context, host string) (*MemoryS3, error) {
	if host == "" {
		host = "127.0.0.1"
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return nil, fmt.Errorf("memory S3: %w", err)
	}
	s := &MemoryS3{addr: ln.Addr().String(), done: make(chan struct{}), objects: map[string]memObject{}}
	s.srv = &http.Server{Handler: http.HandlerFunc(s.serve), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		defer close(s.done)
		_ = s.srv.Serve(ln)
	}()
	return s, nil
}

// Endpoint returns the server's URL, "http://127.0.0.1:<port>".
func (s *MemoryS3) Endpoint() string { return "http://" + s.addr }

// Len returns the number of objects stored.
func (s *MemoryS3) Len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.objects)
}

// Close stops the server, closing its connections, and drops the objects.
func (s *MemoryS3) Close() error {
	var err error
	s.closed.Do(func() {
		err = s.srv.Close()
		<-s.done
		s.mu.Lock()
		s.objects = map[string]memObject{}
		s.mu.Unlock()
	})
	return err
}

func (s *MemoryS3) serve(w http.ResponseWriter, r *http.Request) {
	bucket, key, _ := strings.Cut(strings.TrimPrefix(r.URL.Path, "/"), "/")
	switch {
	case bucket == "":
		s3Error(w, r, http.StatusMethodNotAllowed, "MethodNotAllowed", "listing buckets is not supported")
	case key == "" && r.Method == http.MethodHead:
		w.WriteHeader(http.StatusOK) // every bucket exists
	case key == "":
		s3Error(w, r, http.StatusNotImplemented, "NotImplemented", "bucket operations are not supported")
	case r.Method == http.MethodPut:
		data, err := io.ReadAll(io.LimitReader(r.Body, maxMemObject+1))
		switch {
		case err != nil:
			s3Error(w, r, http.StatusBadRequest, "IncompleteBody", err.Error())
			return
		case len(data) > maxMemObject:
			s3Error(w, r, http.StatusBadRequest, "EntityTooLarge", "objects are limited to 1 MiB")
			return
		}
		sum := md5.Sum(data)
		o := memObject{data: data, etag: `"` + hex.EncodeToString(sum[:]) + `"`, modified: time.Now().UTC()}
		s.mu.Lock()
		s.objects[bucket+"/"+key] = o
		s.mu.Unlock()
		w.Header().Set("ETag", o.etag)
		w.WriteHeader(http.StatusOK)
	case r.Method == http.MethodGet || r.Method == http.MethodHead:
		s.mu.RLock()
		o, ok := s.objects[bucket+"/"+key]
		s.mu.RUnlock()
		if !ok {
			s3Error(w, r, http.StatusNotFound, "NoSuchKey", "The specified key does not exist.")
			return
		}
		h := w.Header()
		h.Set("Content-Type", "application/octet-stream")
		h.Set("Content-Length", strconv.Itoa(len(o.data)))
		h.Set("ETag", o.etag)
		h.Set("Last-Modified", o.modified.Format(http.TimeFormat))
		w.WriteHeader(http.StatusOK)
		if r.Method == http.MethodGet {
			_, _ = w.Write(o.data)
		}
	default:
		s3Error(w, r, http.StatusNotImplemented, "NotImplemented", r.Method+" is not supported")
	}
}

// s3Error answers with an S3 error document (none for HEAD, as S3 does).
func s3Error(w http.ResponseWriter, r *http.Request, status int, code, msg string) {
	if r.Method == http.MethodHead {
		w.WriteHeader(status)
		return
	}
	body, err := xml.Marshal(struct {
		XMLName  xml.Name `xml:"Error"`
		Code     string
		Message  string
		Resource string
	}{Code: code, Message: msg, Resource: r.URL.Path})
	if err != nil {
		body = nil
	}
	w.Header().Set("Content-Type", "application/xml")
	w.WriteHeader(status)
	_, _ = w.Write(append([]byte(xml.Header), body...))
}
