// Package deploy holds no code: it is the directory of kvroute-epp's deployment files, and its
// test checks them.
//
//   - kubernetes/kvroute-epp.yaml: kvroute-epp's ConfigMap (a kvroute config.yaml with the
//     endpoint_picker section), Deployment and Service;
//   - kubernetes/vllm-pool.yaml: the headless Service kvroute-epp resolves to find the vLLM pods,
//     and the Gateway API Inference Extension's InferencePool (inference.networking.k8s.io/v1)
//     naming kvroute-epp as its endpoint picker;
//   - kubernetes/httproute.yaml: the Gateway API HTTPRoute that sends a Gateway's requests to the
//     InferencePool;
//   - envoy/envoy.yaml and envoy/envoy-buffered.yaml: Envoy bootstraps that call kvroute-epp
//     through the ext_proc filter (full-duplex streamed or buffered bodies) and send each request
//     to the engine it picked, without Kubernetes.
//
// The test decodes each Envoy bootstrap into go-control-plane's Bootstrap and applies the
// validation rules Envoy's API carries (protoc-gen-validate), including those of every typed
// extension config; it parses the ConfigMap's configuration with package config, and checks that
// the ports, names and selectors the files share agree and that the InferencePool uses only fields
// of the InferencePool v1 schema. It also parses the configuration blocks of the module's README.
package deploy
