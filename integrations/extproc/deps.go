package extproc

import (
	_ "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	_ "google.golang.org/grpc"
	_ "google.golang.org/grpc/health"
)
