package enginemetrics

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvroute/kvroute"
)

// Engine is the serving engine a metrics body came from, as Parse detects it from the metric names
// present.
type Engine string

// The engines Parse knows.
const (
	EngineVLLM   Engine = "vllm"
	EngineSGLang Engine = "sglang"
)

// The gauges read, by engine. See the package documentation for what each means.
const (
	VLLMRunning       = "vllm:num_requests_running"
	VLLMWaiting       = "vllm:num_requests_waiting"
	VLLMKVCacheUsage  = "vllm:kv_cache_usage_perc"  // vLLM ≥ 0.9.2 (v1 engine)
	VLLMGPUCacheUsage = "vllm:gpu_cache_usage_perc" // older vLLM; hidden since 0.11
	SGLangRunning     = "sglang:num_running_reqs"
	SGLangWaiting     = "sglang:num_queue_reqs"
	SGLangTokenUsage  = "sglang:token_usage"
	// LabelModel is the label both engines put the served model's name in.
	LabelModel = "model_name"
)

var (
	// ErrParse is wrapped by Parse's error for a body that is not in the Prometheus text format.
	ErrParse = errors.New("enginemetrics: malformed metrics body")
	// ErrNoLoadMetrics is wrapped by Parse's error for a well-formed body that lacks an engine's
	// running or waiting gauge (or, with a model, any series of that model), or has both vLLM's
	// and SGLang's.
	ErrNoLoadMetrics = errors.New("enginemetrics: no engine load metrics")
)

// maxCount caps Running and Waiting, so that a hostile value cannot overflow an int.
const maxCount = 1 << 30

// names are one engine's gauges.
type names struct {
	engine           Engine
	running, waiting string
	usage            []string // by preference
}

var engines = [...]names{
	{EngineVLLM, VLLMRunning, VLLMWaiting, []string{VLLMKVCacheUsage, VLLMGPUCacheUsage}},
	{EngineSGLang, SGLangRunning, SGLangWaiting, []string{SGLangTokenUsage}},
}

// Parse reads a metrics body in the Prometheus text format (version 0.0.4, what vLLM's and
// SGLang's /metrics serve unless asked for OpenMetrics), detects the engine from the gauges
// present, and returns the engine's load with At zero. Model, when not empty, keeps only the
// series whose model_name label equals it; otherwise the series of each gauge are summed
// (Running, Waiting) or averaged (KVCacheUsage, in [0, 1]; -1 when the engine reports none).
// Series of another type than gauge or untyped, and samples that are NaN or infinite, are
// ignored; negative counts count as 0.
//
// The error wraps ErrParse for a malformed body and ErrNoLoadMetrics for a body without the
// detected engine's running and waiting gauges (see ErrNoLoadMetrics); the Engine is then "" or
// the engine detected. It reads all of r, which the caller bounds. Safe for concurrent use.
func Parse(r io.Reader, model string) (kvroute.EngineLoad, Engine, error) {
	body, err := io.ReadAll(r)
	if err != nil {
		return kvroute.EngineLoad{}, "", err
	}
	if err := checkShape(body); err != nil {
		return kvroute.EngineLoad{}, "", err
	}
	fams, err := parseText(bytes.NewReader(body))
	if err != nil {
		return kvroute.EngineLoad{}, "", err
	}
	var n *names
	for i := range engines {
		if fams[engines[i].running] == nil && fams[engines[i].waiting] == nil {
			continue
		}
		if n != nil {
			return kvroute.EngineLoad{}, "", fmt.Errorf("%w: both vLLM and SGLang gauges", ErrNoLoadMetrics)
		}
		n = &engines[i]
	}
	if n == nil {
		return kvroute.EngineLoad{}, "", fmt.Errorf("%w: none of %s, %s, %s, %s", ErrNoLoadMetrics,
			VLLMRunning, VLLMWaiting, SGLangRunning, SGLangWaiting)
	}
	l := kvroute.EngineLoad{KVCacheUsage: -1}
	for _, c := range []struct {
		name string
		dst  *int
	}{{n.running, &l.Running}, {n.waiting, &l.Waiting}} {
		sum, k := sumGauge(fams[c.name], model)
		if k == 0 {
			return kvroute.EngineLoad{}, n.engine, fmt.Errorf("%w: no %s series%s", ErrNoLoadMetrics, c.name, ofModel(model))
		}
		*c.dst = int(min(math.Round(max(sum, 0)), maxCount))
	}
	for _, name := range n.usage {
		if sum, k := sumGauge(fams[name], model); k > 0 {
			l.KVCacheUsage = min(max(sum/float64(k), 0), 1)
			break
		}
	}
	return l, n.engine, nil
}

// Bounds of a line of a metrics body, checked before it is parsed. expfmt's text parser takes time
// that grows faster than linearly with a series' labels (16,000 labels on one line, 149 KB, took
// 29 s), and an engine's series carry a handful: a body beyond these is refused (ErrParse).
const (
	MaxLineBytes = 64 << 10
	MaxLabels    = 64
)

// checkShape refuses a body with a line longer than MaxLineBytes or a series with more than
// MaxLabels labels (counted as the label values' opening quotes, `="`, on a sample line), in one
// linear pass.
func checkShape(b []byte) error {
	for len(b) > 0 {
		line := b
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			line, b = b[:i], b[i+1:]
		} else {
			b = nil
		}
		if len(line) > MaxLineBytes {
			return fmt.Errorf("%w: a line of %d bytes (at most %d)", ErrParse, len(line), MaxLineBytes)
		}
		if len(line) > 0 && line[0] != '#' {
			if n := bytes.Count(line, []byte(`="`)); n > MaxLabels {
				return fmt.Errorf("%w: a series with %d labels (at most %d)", ErrParse, n, MaxLabels)
			}
		}
	}
	return nil
}

// parseText parses r with expfmt's text parser. Metric names are checked as UTF-8, the laxer
// scheme, so that one family with a name outside the legacy character set does not fail the body.
// A panic of the parser on hostile input is returned as an error.
func parseText(r io.Reader) (fams map[string]*dto.MetricFamily, err error) {
	defer func() {
		if p := recover(); p != nil {
			fams, err = nil, fmt.Errorf("%w: parser panicked: %v", ErrParse, p)
		}
	}()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err = p.TextToMetricFamilies(r)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrParse, err)
	}
	return fams, nil
}

// sumGauge returns the sum of mf's finite samples of model (every sample when model is "") and
// how many there were; 0, 0 when mf is nil or neither a gauge nor untyped.
func sumGauge(mf *dto.MetricFamily, model string) (sum float64, n int) {
	if mf == nil {
		return 0, 0
	}
	typ := mf.GetType()
	if typ != dto.MetricType_GAUGE && typ != dto.MetricType_UNTYPED {
		return 0, 0
	}
	for _, m := range mf.GetMetric() {
		if model != "" && labelValue(m, LabelModel) != model {
			continue
		}
		v := m.GetGauge().GetValue()
		if typ == dto.MetricType_UNTYPED {
			v = m.GetUntyped().GetValue()
		}
		if math.IsNaN(v) || math.IsInf(v, 0) {
			continue
		}
		sum += v
		n++
	}
	return sum, n
}

func labelValue(m *dto.Metric, name string) string {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue()
		}
	}
	return ""
}

func ofModel(model string) string {
	if model == "" {
		return ""
	}
	return fmt.Sprintf(" of model %q", model)
}
