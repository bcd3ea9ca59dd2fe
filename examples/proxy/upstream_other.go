//go:build !unix

package main

import "net"

// peerProbe reports false: without a non-blocking read, an idle connection's peer close shows
// when the connection is used, and upstreamTransport.RoundTrip retries the request once then.
type peerProbe struct{}

func (*peerProbe) init(net.Conn) {}

func (*peerProbe) closed() bool { return false }
