// Command relay is the floor the reference proxy's overhead is compared with: an HTTP/1.1 relay
// that does nothing a proxy could skip. Each client connection gets one goroutine and one
// upstream connection of its own; a message (request or response) is its head, read line by
// line, and a body of Content-Length bytes, copied whole. No routing, no header rewriting, no
// chunked bodies (a message without Content-Length has none), no metrics: what it costs per
// request is what any Go proxy on the machine pays for the system calls, the scheduler and the
// copies.
//
//	go run ./benchmarks/cmd/relay -addr 127.0.0.1:18090 -upstream 127.0.0.1:18001
//
// BENCHMARKS.md ("Reference proxy overhead") measures it beside the proxy.
package main

import (
	"bufio"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"strconv"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:18090", "listen address")
	upstream := flag.String("upstream", "127.0.0.1:18001", "upstream host:port")
	flag.Parse()
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("relay %s -> %s", ln.Addr(), *upstream)
	log.Fatal(serve(ln, *upstream))
}

// serve accepts client connections on ln and relays each to a connection of its own to upstream.
func serve(ln net.Listener, upstream string) error {
	for {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		go relay(c, upstream)
	}
}

// relay passes requests from c to upstream and responses back, one at a time, until either side
// closes or sends something it cannot relay.
func relay(c net.Conn, upstream string) {
	defer c.Close()
	u, err := net.Dial("tcp", upstream)
	if err != nil {
		return
	}
	defer u.Close()
	cr, ur := bufio.NewReader(c), bufio.NewReader(u)
	var buf []byte
	for {
		if buf, err = readMessage(cr, buf[:0]); err != nil {
			return
		}
		if _, err = u.Write(buf); err != nil {
			return
		}
		if buf, err = readMessage(ur, buf[:0]); err != nil {
			return
		}
		if _, err = c.Write(buf); err != nil {
			return
		}
	}
}

// maxBody bounds a message's Content-Length.
const maxBody = 64 << 20

var contentLength = []byte("content-length:")

// readMessage appends one HTTP/1.1 message from r to dst: the head up to its empty line, and
// Content-Length bytes of body.
func readMessage(r *bufio.Reader, dst []byte) ([]byte, error) {
	n := 0
	for {
		line, err := r.ReadSlice('\n')
		if err != nil {
			return dst, err
		}
		dst = append(dst, line...)
		if len(line) <= 2 { // CRLF or LF: the end of the head
			break
		}
		if len(line) > len(contentLength) && bytes.EqualFold(line[:len(contentLength)], contentLength) {
			v, err := strconv.Atoi(string(bytes.TrimSpace(line[len(contentLength):])))
			if err != nil || v < 0 || v > maxBody {
				return dst, fmt.Errorf("relay: bad Content-Length %q", bytes.TrimSpace(line))
			}
			n = v
		}
	}
	if len(dst) == 2 {
		return dst, errors.New("relay: empty message")
	}
	head := len(dst)
	dst = append(dst, make([]byte, n)...)
	_, err := io.ReadFull(r, dst[head:])
	return dst, err
}
