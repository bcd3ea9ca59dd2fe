package health

// CircuitState is the state of a backend's circuit breaker.
type CircuitState string

// The states of a circuit breaker. A circuit starts closed.
const (
	// CircuitClosed: requests flow; consecutive failures are counted.
	CircuitClosed CircuitState = "closed"
	// CircuitOpen: the backend is out of rotation and Admit refuses it until the recovery
	// timeout has passed.
	CircuitOpen CircuitState = "open"
	// CircuitHalfOpen: the backend is back in rotation on trial; Admit lets through a bounded
	// number of trial requests whose outcomes close or re-open the circuit.
	CircuitHalfOpen CircuitState = "half_open"
)

// breaker is one backend's circuit breaker. It is not safe for concurrent use; the backend's
// mutex guards it.
//
// Every state change starts a new generation. A request is admitted in one generation and its
// outcome counts only while that generation lasts: the outcome of a request admitted before the
// circuit opened (or before it turned half-open, or closed) changes nothing. Without that rule a
// slow request that started while the circuit was closed and succeeded after it opened would
// close it again with no trial at all.
type breaker struct {
	threshold int // consecutive failures that open a closed circuit
	maxTrials int // trial requests of a half-open circuit

	state     CircuitState
	gen       uint64
	failures  int    // closed: consecutive failures in this generation
	trials    int    // half-open: trials admitted and not cancelled
	successes int    // half-open: trials that succeeded
	opens     uint64 // times the circuit opened
}

func newBreaker(cfg BreakerConfig) breaker {
	return breaker{threshold: cfg.FailureThreshold, maxTrials: cfg.HalfOpenMaxRequests, state: CircuitClosed}
}

// admit reports whether a request may be sent now, and the generation its outcome belongs to.
// In the half-open state an admitted request takes a trial slot.
func (b *breaker) admit() (gen uint64, ok bool) {
	switch b.state {
	case CircuitOpen:
		return b.gen, false
	case CircuitHalfOpen:
		if b.trials >= b.maxTrials {
			return b.gen, false
		}
		b.trials++
	}
	return b.gen, true
}

// cancel gives back the trial slot of a request of generation gen that ended without an outcome
// (its client left, say).
func (b *breaker) cancel(gen uint64) {
	if gen == b.gen && b.state == CircuitHalfOpen {
		b.trials--
	}
}

// done records the outcome of a request of generation gen and returns the state it left, or ""
// when the state did not change. Outcomes of other generations are ignored.
func (b *breaker) done(gen uint64, failed bool) (from CircuitState) {
	if gen != b.gen {
		return ""
	}
	switch b.state {
	case CircuitClosed:
		if !failed {
			b.failures = 0
			return ""
		}
		b.failures++
		if b.failures >= b.threshold {
			return b.set(CircuitOpen)
		}
	case CircuitHalfOpen:
		if failed {
			return b.set(CircuitOpen)
		}
		b.successes++
		if b.successes >= b.maxTrials {
			return b.set(CircuitClosed)
		}
	}
	return ""
}

// halfOpen turns an open circuit of generation gen half-open and returns true, or returns false
// when the circuit has left that generation since.
func (b *breaker) halfOpen(gen uint64) bool {
	if gen != b.gen || b.state != CircuitOpen {
		return false
	}
	b.set(CircuitHalfOpen)
	return true
}

// set moves to state in a new generation and returns the state it left.
func (b *breaker) set(state CircuitState) (from CircuitState) {
	from = b.state
	b.state = state
	b.gen++
	b.failures, b.trials, b.successes = 0, 0, 0
	if state == CircuitOpen {
		b.opens++
	}
	return from
}
