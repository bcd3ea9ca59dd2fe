// Package traces ships the request traces the replay harness reads by default, so that
// go run ./benchmarks/cmd/replay works on a fresh clone. The synthetic trace is in Mooncake's
// format (JSON lines, gzip-compressed); LICENSE-mooncake-traces beside it is its license.
package traces

import _ "embed"

// MooncakeSyntheticName is the file name of MooncakeSynthetic.
const MooncakeSyntheticName = "mooncake_synthetic_trace.jsonl.gz"

// MooncakeSynthetic is the synthetic Mooncake-format trace, gzip-compressed.
//
//go:embed mooncake_synthetic_trace.jsonl.gz
var MooncakeSynthetic []byte
