//go:build !unix

package main

import "net"

// peerClosed reports false: without a non-blocking read, an idle connection's peer close shows
// when the connection is used, and upstreamTransport.RoundTrip retries the request once then.
func peerClosed(net.Conn) bool { return false }
