package main

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"time"
)

// Pass criteria.
const (
	resourceSlack   = 0.10             // RSS, goroutines and open files back within 10 % of the baseline
	kvShareFloor    = 0.90             // the KV-aware share back to 90 % of the baseline's
	kvShareWithin   = 10 * time.Second // ... within this of each fault's end
	kvShareWindow   = 5                // seconds of decisions per share value
	cacheStoreDelay = time.Second      // a stored answer is expected from this long after its MISS ended
	redisGrace      = 3 * time.Second  // after Redis restarts, the proxies' clients reconnect
	stableSeconds   = 3                // recovered: this many seconds in a row without a failure
)

var classNames = map[int]string{classFailPre: "failed before the first byte", classFailMid: "cut mid-stream",
	classFailMidDead: "cut mid-stream by its engine's death"}

// runEnv describes where a run ran, for the report's header.
type runEnv struct{ command, commit, goVersion, cpu string }

// second is one second of the run.
type second struct {
	ok, rejected, failPre, failMid, failMidDead int
	hits                                        int     // X-Cache: HIT
	p50, p99                                    float64 // ms of the ok requests; NaN without any
	kvShare                                     float64 // over the last kvShareWindow seconds; NaN without decisions
	rss, goroutines, fds                        []float64
	faults                                      []string // faults in progress
}

// faultResult is the summary of one fault.
type faultResult struct {
	faultRecord
	recovered     time.Duration // from the fault's end to recovery; -1: not within its slot
	failPre       int           // failed before the first byte, from its start to its slot's end
	failMidDead   int
	failMid       int
	before, after [3][]float64  // RSS, goroutines, fds per proxy over slot.window() before it and at its slot's end
	kvBack        time.Duration // from its end to the KV-aware share's return; -1: not seen
	resourcesPass bool
	judged        bool // the after-state's window starts -conn-idle or more after the fault's end
}

// analysis is a run's result: the series, the faults and the verdicts.
type analysis struct {
	o          options
	env        runEnv
	proxies    int
	seconds    []second
	faults     []faultResult
	baseline   [3][]float64 // RSS (MB), goroutines, fds per proxy
	baseKV     float64
	totals     second
	cacheLost  int // expected hits that missed
	cacheCheck int // expected hits checked
	warmupFail int // failures before the first fault
	lost       []string
	p50, p99   float64 // ms, over the run, of the chats and deterministic requests answered
	baseWindow time.Duration
	cacheLog   []string // the first lost answers
}

// analyze turns the raw records into the analysis.
func analyze(o options, sched []slot, recs []faultRecord, outs []outcome, samples []sample, proxies int) *analysis {
	a := &analysis{o: o, proxies: proxies}
	n := int(math.Ceil(o.duration.Seconds())) + 1
	for _, out := range outs {
		n = max(n, int(out.end/time.Second)+1)
	}
	a.seconds = make([]second, n)
	for i := range a.seconds {
		s := &a.seconds[i]
		s.p50, s.p99, s.kvShare = math.NaN(), math.NaN(), math.NaN()
		s.rss, s.goroutines, s.fds = nanSlice(proxies), nanSlice(proxies), nanSlice(proxies)
		for _, r := range recs {
			if time.Duration(i)*time.Second < r.end+time.Second && time.Duration(i+1)*time.Second > r.start {
				s.faults = append(s.faults, r.fault)
			}
		}
	}
	// Outcomes: classes (an engine's death explains a cut), per second by end.
	lat := make([][]float64, n)
	for i := range outs {
		out := &outs[i]
		if out.class == classFailMid && killedDuring(recs, out.backend, out.start, out.end) {
			out.class = classFailMidDead
		}
		s := &a.seconds[out.end/time.Second]
		switch out.class {
		case classOK:
			s.ok++
			if out.kind == kindChat || out.kind == kindChatStream || out.kind == kindDeterm { // not the slow clients' own time
				lat[out.end/time.Second] = append(lat[out.end/time.Second], float64(out.end-out.start)/1e6)
			}
		case classRejected:
			s.rejected++
		case classFailPre:
			s.failPre++
		case classFailMid:
			s.failMid++
		case classFailMidDead:
			s.failMidDead++
		}
		if out.cache == "HIT" {
			s.hits++
		}
		if out.class != classOK && out.class != classRejected && len(a.lost) < 10 {
			a.lost = append(a.lost, fmt.Sprintf("%.1fs %s, %s: %s", out.start.Seconds(), out.kind, classNames[out.class], out.err))
		}
	}
	var all []float64
	for _, l := range lat {
		all = append(all, l...)
	}
	a.p50, a.p99 = quantile(all, 0.50), quantile(all, 0.99)
	for i := range a.seconds {
		a.seconds[i].p50, a.seconds[i].p99 = quantile(lat[i], 0.50), quantile(lat[i], 0.99)
		t := &a.totals
		s := a.seconds[i]
		t.ok, t.rejected, t.failPre, t.failMid, t.failMidDead, t.hits = t.ok+s.ok, t.rejected+s.rejected, t.failPre+s.failPre,
			t.failMid+s.failMid, t.failMidDead+s.failMidDead, t.hits+s.hits
	}
	// Samples: resources per second; the KV-aware share over a window of decisions.
	type kv struct{ aware, total float64 }
	dec := make([]kv, n)
	var prev []proxySample
	for _, sm := range samples {
		i := int(sm.at / time.Second)
		if i >= n {
			continue
		}
		for p, ps := range sm.proxies {
			if !ps.up {
				continue
			}
			a.seconds[i].rss[p], a.seconds[i].goroutines[p], a.seconds[i].fds[p] = float64(ps.rss)/1e6, float64(ps.goroutines), float64(ps.fds)
			if prev != nil && prev[p].up && ps.kvTotal >= prev[p].kvTotal {
				dec[i].aware += ps.kvAware - prev[p].kvAware
				dec[i].total += ps.kvTotal - prev[p].kvTotal
			}
		}
		prev = sm.proxies
	}
	for i := range a.seconds {
		var w kv
		for j := max(0, i-kvShareWindow+1); j <= i; j++ {
			w.aware, w.total = w.aware+dec[j].aware, w.total+dec[j].total
		}
		if w.total > 0 {
			a.seconds[i].kvShare = w.aware / w.total
		}
	}
	// Baseline: the settle window before the first fault (or the end), for the report; each
	// fault's own is the settle window before it.
	baseEnd, baseLen := o.duration, settleWindow
	if len(sched) > 0 {
		baseEnd, baseLen = sched[0].at, sched[0].window()
	}
	a.baseWindow = baseLen
	a.baseline = a.medians(baseEnd-baseLen, baseEnd)
	a.baseKV = a.kvOver(baseEnd-settleWindow, baseEnd)
	for _, s := range a.seconds[:min(n, int(baseEnd/time.Second))] {
		a.warmupFail += s.failPre + s.failMid
	}
	// Faults.
	for _, r := range recs {
		fr := faultResult{faultRecord: r, recovered: -1, kvBack: -1, resourcesPass: true}
		for _, out := range outs {
			if out.end < r.start || out.end >= r.slotEnd {
				continue
			}
			switch out.class {
			case classFailPre:
				fr.failPre++
			case classFailMid:
				fr.failMid++
			case classFailMidDead:
				fr.failMidDead++
			}
		}
		fr.before = a.medians(r.at-r.window(), r.at)
		fr.after = a.medians(r.slotEnd-r.window(), r.slotEnd)
		fr.before[0] = a.medians(r.at-r.rssWindow(), r.at)[0]
		fr.after[0] = a.medians(r.slotEnd-r.rssWindow(), r.slotEnd)[0]
		fr.judged = r.slotEnd-r.window()-r.end >= o.connIdle
		for k := range fr.after {
			if !fr.judged {
				break
			}
			for p := range fr.after[k] {
				if !(fr.after[k][p] <= fr.before[k][p]*(1+resourceSlack)) {
					fr.resourcesPass = false
				}
			}
		}
		if r.fault == faultEngine { // its sign: the restarted engine answered a request again
			for _, out := range outs {
				if out.class == classOK && out.start >= r.end && "engine "+out.backend+" killed" == r.label &&
					(fr.ready < 0 || out.end < fr.ready) {
					fr.ready = out.end
				}
			}
		}
		fr.recovered = a.recoveredAfter(fr.faultRecord)
		for i := int(r.end / time.Second); i < n && time.Duration(i)*time.Second < r.slotEnd+kvShareWithin; i++ {
			if v := a.seconds[i].kvShare; v >= a.baseKV*kvShareFloor {
				fr.kvBack = max(0, time.Duration(i)*time.Second-r.end)
				break
			}
		}
		a.faults = append(a.faults, fr)
	}
	a.cacheLost, a.cacheCheck, a.cacheLog = cacheLosses(outs, recs)
	return a
}

func nanSlice(n int) []float64 {
	s := make([]float64, n)
	for i := range s {
		s[i] = math.NaN()
	}
	return s
}

// killedDuring reports whether the engine backend was killed by a fault from a second before
// start to a second after end.
func killedDuring(recs []faultRecord, backend string, start, end time.Duration) bool {
	for _, r := range recs {
		if r.fault == faultEngine && r.label == "engine "+backend+" killed" && r.start >= start-time.Second && r.start <= end+time.Second {
			return true
		}
	}
	return false
}

// medians returns per proxy the median RSS and the least goroutines and open files over
// [from, to): the floor of the counts is what a leak raises, while the requests in flight at the
// moment of a reading (each a connection and a few goroutines) move the rest.
func (a *analysis) medians(from, to time.Duration) [3][]float64 {
	var m [3][]float64
	for k := range m {
		m[k] = nanSlice(a.proxies)
	}
	for p := range a.proxies {
		var v [3][]float64
		for i := max(0, int(from/time.Second)); i < len(a.seconds) && time.Duration(i)*time.Second < to; i++ {
			s := a.seconds[i]
			for k, x := range []float64{s.rss[p], s.goroutines[p], s.fds[p]} {
				if !math.IsNaN(x) {
					v[k] = append(v[k], x)
				}
			}
		}
		m[0][p], m[1][p], m[2][p] = quantile(v[0], 0.5), quantile(v[1], 0), quantile(v[2], 0)
	}
	return m
}

// kvOver returns the KV-aware share of the decisions over [from, to): the mean of the seconds'.
func (a *analysis) kvOver(from, to time.Duration) float64 {
	var sum float64
	var k int
	for i := max(0, int(from/time.Second)); i < len(a.seconds) && time.Duration(i)*time.Second < to; i++ {
		if v := a.seconds[i].kvShare; !math.IsNaN(v) {
			sum, k = sum+v, k+1
		}
	}
	if k == 0 {
		return math.NaN()
	}
	return sum / float64(k)
}

// recoveredAfter returns the time from r's end to its recovery: its own sign (r.ready) seen and
// stableSeconds in a row with requests answered and none failed; -1 when not within its slot.
func (a *analysis) recoveredAfter(r faultRecord) time.Duration {
	if (r.fault == faultEngine || r.fault == faultRedis || r.fault == faultNATS || r.fault == faultEvents) && r.ready < 0 {
		return -1
	}
	from := r.end
	if r.ready > from {
		from = r.ready
	}
	run := 0
	for i := int(from / time.Second); i < len(a.seconds) && time.Duration(i)*time.Second < r.slotEnd; i++ {
		s := a.seconds[i]
		if s.ok > 0 && s.failPre+s.failMid+s.failMidDead == 0 {
			run++
			if run == stableSeconds {
				return max(0, time.Duration(i+1-stableSeconds)*time.Second-r.end)
			}
		} else {
			run = 0
		}
	}
	return -1
}

// cacheLosses checks the response cache across Redis restarts: a deterministic request whose
// answer was stored (an ok MISS) while Redis was up is expected to be a HIT when it is repeated
// at least cacheStoreDelay later, with Redis up from the ask's start to its end and not killed
// in between. It returns the
// expected hits that missed and the expected hits checked.
func cacheLosses(outs []outcome, recs []faultRecord) (lost, checked int, log []string) {
	var redis []faultRecord
	for _, r := range recs {
		if r.fault == faultRedis {
			redis = append(redis, r)
		}
	}
	up := func(t time.Duration) bool {
		for _, r := range redis {
			if t >= r.start && t < r.end+redisGrace {
				return false
			}
		}
		return true
	}
	killedBetween := func(a, b time.Duration) bool {
		for _, r := range redis {
			if r.start >= a && r.start <= b {
				return true
			}
		}
		return false
	}
	var determ []outcome
	for _, o := range outs {
		if o.determ >= 0 && o.class == classOK {
			determ = append(determ, o)
		}
	}
	sort.SliceStable(determ, func(i, j int) bool { return determ[i].start < determ[j].start })
	stored := map[int]time.Duration{} // determ -> end of the MISS that stored it
	for _, o := range determ {
		at, ok := stored[o.determ]
		// The whole ask happens with Redis up: an ask that began just before the kill may reach
		// the cache after it.
		if ok && o.start >= at+cacheStoreDelay && up(o.start) && up(o.end) && !killedBetween(at, o.end) {
			checked++
			if o.cache != "HIT" {
				lost++
				if len(log) < 5 {
					log = append(log, fmt.Sprintf("deterministic request %d stored at %.1f s, asked at %.1f s: X-Cache %q",
						o.determ, at.Seconds(), o.start.Seconds(), o.cache))
				}
			}
		}
		if o.cache == "MISS" && up(o.start) && up(o.end) {
			stored[o.determ] = o.end
		}
	}
	return lost, checked, log
}

// quantile returns the q-quantile of v (nearest rank), NaN for none. It sorts v.
func quantile(v []float64, q float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	slices.Sort(v)
	return v[min(len(v)-1, max(0, int(math.Ceil(q*float64(len(v))))-1))]
}

// failures lists the pass criteria the run failed.
func (a *analysis) failures() []string {
	var f []string
	if a.totals.failPre > 0 {
		f = append(f, fmt.Sprintf("%d requests failed before the first byte while a healthy engine existed", a.totals.failPre))
	}
	if a.totals.failMid > 0 {
		f = append(f, fmt.Sprintf("%d requests were cut mid-stream with no engine killed", a.totals.failMid))
	}
	for _, fr := range a.faults {
		if !fr.resourcesPass {
			f = append(f, fmt.Sprintf("%s: RSS, goroutines or open files not back within %.0f %% of their values before it", fr.label, resourceSlack*100))
		}
		if !math.IsNaN(a.baseKV) && (fr.kvBack < 0 || fr.kvBack > kvShareWithin) {
			f = append(f, fmt.Sprintf("%s: KV-aware share not back to %.0f %% of the baseline within %v", fr.label, kvShareFloor*100, kvShareWithin))
		}
	}
	if math.IsNaN(a.baseKV) || a.baseKV == 0 {
		f = append(f, "no KV-aware decision in the baseline")
	}
	if a.cacheLost > 0 {
		f = append(f, fmt.Sprintf("the response cache lost %d of %d answers stored while Redis was up", a.cacheLost, a.cacheCheck))
	}
	return f
}

func (a *analysis) pass() bool { return len(a.failures()) == 0 }
