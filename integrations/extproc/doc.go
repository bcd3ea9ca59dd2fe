// Package extproc is kvroute as an endpoint picker for Envoy and the Gateway API Inference
// Extension: a gRPC server of Envoy's external processing protocol (envoy.service.ext_proc.v3)
// that reads each request's headers and body as Envoy streams them, asks a kvroute Router which
// model server holds the most of the request's KV cache, and answers with the endpoint in the
// x-gateway-destination-endpoint header and the envoy.lb dynamic metadata, as the Inference
// Extension's Endpoint Picker Protocol prescribes. It then watches the response go by to tell the
// Router when the first token came and how the request ended.
package extproc
