package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// Requests and responses with bodies of known length pass through unchanged, several on one
// connection.
func TestRelay(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Length", fmt.Sprint(len(b)+len(r.URL.Path)))
		_, _ = io.WriteString(w, r.URL.Path)
		_, _ = w.Write(b)
	}))
	defer up.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() { _ = serve(ln, strings.TrimPrefix(up.URL, "http://")) }()

	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	for i, body := range []string{"", "hello", strings.Repeat("x", 100_000)} {
		req, _ := http.NewRequest(http.MethodPost, fmt.Sprintf("http://relay/r%d", i), strings.NewReader(body))
		if err := req.Write(c); err != nil {
			t.Fatal(err)
		}
		res, err := http.ReadResponse(br, req)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		got, _ := io.ReadAll(res.Body)
		if want := fmt.Sprintf("/r%d", i) + body; res.StatusCode != 200 || string(got) != want {
			t.Fatalf("request %d: %d, %d bytes, want %d", i, res.StatusCode, len(got), len(want))
		}
	}
}

func TestReadMessageRejectsBadLength(t *testing.T) {
	for _, head := range []string{"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n", "POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n"} {
		if _, err := readMessage(bufio.NewReader(strings.NewReader(head)), nil); err == nil {
			t.Errorf("%q: no error", head)
		}
	}
}
