// Command caddy-kvroute is Caddy with the kvroute module built in, as xcaddy builds it:
//
//	go build ./integrations/caddy/cmd/caddy-kvroute
//	./caddy-kvroute run --config Caddyfile
//
// It is Caddy's own command with the standard modules and this repository's kvroute module
// (http.handlers.kvroute, http.reverse_proxy.selection_policies.kvroute, admin.api.kvroute).
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/kvroute/kvroute/integrations/caddy"
)

func main() {
	caddycmd.Main()
}
