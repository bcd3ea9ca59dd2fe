package replay

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"time"
)

// Segment is a run of prompt tokens identified by ID: every request whose prompt holds segment ID
// at the same place after the same segments holds the same tokens there. A trace's hash id is a
// segment of 512 tokens; a generator's shared prefix, question or chat turn is one segment.
// Tokens is how many of the segment's tokens the request holds (a prefix of them).
type Segment struct {
	ID     uint64
	Tokens int
}

// Request is one request of a workload: when it arrives (from the workload's start, before the
// utilisation scaling), its prompt as segments, and how many tokens it generates.
type Request struct {
	Arrival      time.Duration
	Segments     []Segment
	OutputTokens int
}

// InputTokens returns the prompt length: the sum of the segments' tokens.
func (r *Request) InputTokens() int {
	n := 0
	for _, s := range r.Segments {
		n += s.Tokens
	}
	return n
}

// Workload is a named list of requests in arrival order.
type Workload struct {
	Name     string
	Requests []Request
}

// Limit returns the workload's first n requests (all of them when n ≤ 0 or n ≥ the length).
func (w *Workload) Limit(n int) *Workload {
	if n <= 0 || n >= len(w.Requests) {
		return w
	}
	return &Workload{Name: w.Name, Requests: w.Requests[:n]}
}

// Span returns the time from the first arrival to the last.
func (w *Workload) Span() time.Duration {
	if len(w.Requests) == 0 {
		return 0
	}
	return w.Requests[len(w.Requests)-1].Arrival - w.Requests[0].Arrival
}

// WithCommonPrefix returns a copy of w whose every prompt starts with the same segment of tokens
// tokens (a system prompt shared by every request): the worst case for routing by prefix, since
// every request then has the same first block and the same prefix key.
func (w *Workload) WithCommonPrefix(tokens int) *Workload {
	if tokens <= 0 {
		return w
	}
	out := &Workload{Name: w.Name + "+common" + strconv.Itoa(tokens), Requests: make([]Request, len(w.Requests))}
	for i, r := range w.Requests {
		segs := make([]Segment, 0, len(r.Segments)+1)
		segs = append(segs, Segment{ID: commonSegment, Tokens: tokens})
		r.Segments = append(segs, r.Segments...)
		out.Requests[i] = r
	}
	return out
}

// Segment ID spaces: trace hash ids are used as they are (below 2⁶⁰); generated and private
// segments live above.
const (
	commonSegment  uint64 = 1 << 62
	privateSpace   uint64 = 1<<62 + 1<<61
	generatedSpace uint64 = 1 << 61
)

// vocab is the token ID range of synthesized tokens (Llama 3's ordinary tokens).
const vocab = 128_000

// appendTokens appends the synthesized token IDs of r's prompt to dst: segment s's k-th token is
// a function of (seed, s.ID, k) alone, so that equal segments give equal tokens and the engines'
// and kvroute's block keys see the sharing the workload describes.
func appendTokens(dst []uint32, r *Request, seed uint64) []uint32 {
	for _, s := range r.Segments {
		x := splitmix(seed ^ (s.ID * 0x9e3779b97f4a7c15))
		for range s.Tokens {
			x += 0x9e3779b97f4a7c15
			z := x
			z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
			z = (z ^ (z >> 27)) * 0x94d049bb133111eb
			z ^= z >> 31
			dst = append(dst, uint32((z>>32)*vocab>>32))
		}
	}
	return dst
}

// splitmix is SplitMix64's output function (Steele, Lea, Flood, "Fast splittable pseudorandom
// number generators", OOPSLA 2014).
func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// anchorText is the text a request's prefix key is computed over: its system prompt. A prompt's
// first 1 KiB of text is about 256 tokens, inside its first segment, so the anchor names the first
// segment (and the seed, which salts every synthesized token).
func anchorText(r *Request, seed uint64) string {
	if len(r.Segments) == 0 {
		return ""
	}
	b := make([]byte, 0, 48)
	b = append(b, "system prompt "...)
	b = strconv.AppendUint(b, seed, 16)
	b = append(b, '-')
	b = strconv.AppendUint(b, r.Segments[0].ID, 16)
	return string(b)
}

// SharedPrefixConfig configures the shared-prefix generator: Groups groups of UsersPerGroup users;
// every user of a group sends the group's PrefixTokens-token system prompt followed by the user's
// own QuestionTokens-token question (one fixed prompt per user); Requests requests pick a user
// uniformly at random and arrive as a Poisson process of Rate per second. The zero value of a field
// means its default: 150 groups × 5 users, 6,000-token prefix, 1,200-token question, 1,000 output
// tokens, 4,000 requests, rate 10/s.
type SharedPrefixConfig struct {
	Groups         int
	UsersPerGroup  int
	PrefixTokens   int
	QuestionTokens int
	OutputTokens   int
	Requests       int
	Rate           float64
	Seed           uint64
}

// SharedPrefix generates the shared-prefix workload.
func SharedPrefix(cfg SharedPrefixConfig) (*Workload, error) {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&cfg.Groups, 150)
	def(&cfg.UsersPerGroup, 5)
	def(&cfg.PrefixTokens, 6000)
	def(&cfg.QuestionTokens, 1200)
	def(&cfg.OutputTokens, 1000)
	def(&cfg.Requests, 4000)
	if cfg.Rate == 0 {
		cfg.Rate = 10
	}
	if cfg.Groups < 0 || cfg.UsersPerGroup < 0 || cfg.PrefixTokens < 0 || cfg.QuestionTokens < 0 ||
		cfg.OutputTokens < 0 || cfg.Requests < 0 || !(cfg.Rate > 0) || math.IsInf(cfg.Rate, 1) {
		return nil, fmt.Errorf("%w: shared-prefix %+v", ErrInvalidConfig, cfg)
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x5348415245440001))
	w := &Workload{Name: fmt.Sprintf("shared-prefix-%dx%d-%d+%d", cfg.Groups, cfg.UsersPerGroup, cfg.PrefixTokens, cfg.QuestionTokens),
		Requests: make([]Request, cfg.Requests)}
	var t float64
	users := uint64(cfg.Groups * cfg.UsersPerGroup)
	for i := range w.Requests {
		t += rng.ExpFloat64() / cfg.Rate
		u := rng.Uint64N(users)
		g := u / uint64(cfg.UsersPerGroup)
		w.Requests[i] = Request{
			Arrival: time.Duration(t * float64(time.Second)),
			Segments: []Segment{
				{ID: generatedSpace | g<<20, Tokens: cfg.PrefixTokens},
				{ID: generatedSpace | g<<20 | (u+1)&(1<<20-1), Tokens: cfg.QuestionTokens},
			},
			OutputTokens: cfg.OutputTokens,
		}
	}
	return w, nil
}

// MultiTurnConfig configures the multi-turn chat generator: Conversations conversations start as a
// Poisson process of Rate per second; each has Turns turns separated by an exponential think time
// of mean ThinkTime after the previous answer would have ended; each prompt is one of SystemPrompts
// system prompts of SystemTokens tokens (shared across conversations), then the whole history —
// every earlier user message and answer — then the new user message (uniform in [UserTokens/2,
// 3·UserTokens/2]); answers have OutputTokens tokens. Zero fields mean the defaults: 400
// conversations, 8 turns, 10 system prompts of 2,000 tokens, 400-token user messages,
// 300-token answers, 5 s think time, 2 conversations per second.
type MultiTurnConfig struct {
	Conversations int
	Turns         int
	SystemPrompts int
	SystemTokens  int
	UserTokens    int
	OutputTokens  int
	ThinkTime     time.Duration
	Rate          float64
	Seed          uint64
}

// MultiTurn generates the multi-turn chat workload, its requests sorted by arrival.
func MultiTurn(cfg MultiTurnConfig) (*Workload, error) {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&cfg.Conversations, 400)
	def(&cfg.Turns, 8)
	def(&cfg.SystemPrompts, 10)
	def(&cfg.SystemTokens, 2000)
	def(&cfg.UserTokens, 400)
	def(&cfg.OutputTokens, 300)
	if cfg.ThinkTime == 0 {
		cfg.ThinkTime = 5 * time.Second
	}
	if cfg.Rate == 0 {
		cfg.Rate = 2
	}
	if cfg.Conversations < 0 || cfg.Turns < 0 || cfg.SystemPrompts < 1 || cfg.SystemTokens < 0 ||
		cfg.UserTokens < 0 || cfg.OutputTokens < 0 || cfg.ThinkTime < 0 || !(cfg.Rate > 0) || math.IsInf(cfg.Rate, 1) {
		return nil, fmt.Errorf("%w: multi-turn %+v", ErrInvalidConfig, cfg)
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x4d554c5449540002))
	w := &Workload{Name: fmt.Sprintf("multi-turn-%dx%d", cfg.Conversations, cfg.Turns),
		Requests: make([]Request, 0, cfg.Conversations*cfg.Turns)}
	var start float64
	for c := range cfg.Conversations {
		start += rng.ExpFloat64() / cfg.Rate
		t := start
		sys := Segment{ID: generatedSpace | 1<<59 | rng.Uint64N(uint64(cfg.SystemPrompts)), Tokens: cfg.SystemTokens}
		history := []Segment{sys}
		for turn := range cfg.Turns {
			user := cfg.UserTokens/2 + int(rng.Uint64N(uint64(cfg.UserTokens)+1))
			id := generatedSpace | 1<<58 | uint64(c)<<16 | uint64(turn)<<1
			history = append(history, Segment{ID: id, Tokens: user})
			w.Requests = append(w.Requests, Request{
				Arrival:      time.Duration(t * float64(time.Second)),
				Segments:     append([]Segment(nil), history...),
				OutputTokens: cfg.OutputTokens,
			})
			history = append(history, Segment{ID: id | 1, Tokens: cfg.OutputTokens})
			// The next turn comes after this answer would be read: an estimate of the answer's time
			// at 20 ms per token plus the think time.
			t += float64(cfg.OutputTokens)*0.02 + rng.ExpFloat64()*cfg.ThinkTime.Seconds()
		}
	}
	sortByArrival(w.Requests)
	return w, nil
}

// ErrInvalidConfig is wrapped by the errors of generators and Run for a configuration they reject.
var ErrInvalidConfig = errors.New("replay: invalid config")
