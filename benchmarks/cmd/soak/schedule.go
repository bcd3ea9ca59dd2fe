package main

import (
	"fmt"
	"time"
)

// settleWindow is the shortest span whose readings are compared: a fault's after-state is read
// over the end of its slot, its before-state over as long a span before it (the end of the
// previous slot): RSS over half the slot (the collector's saw-tooth spans tens of seconds), the
// goroutines and open files over its last resourceWindow at most (the connections opened for a
// fault's retries close -conn-idle after it).
const (
	settleWindow   = 5 * time.Second
	resourceWindow = 10 * time.Second
)

// window is how long s's goroutines and open files are read over, before and after it.
func (s slot) window() time.Duration {
	return max(settleWindow, min(resourceWindow, (s.slotEnd-s.at)/2))
}

// rssWindow is how long s's RSS is read over, before and after it.
func (s slot) rssWindow() time.Duration { return max(settleWindow, (s.slotEnd-s.at)/2) }

// slot is one fault of the schedule: it starts at at (from the start of the load) and its
// after-state is measured at the end of its slot, just before the next fault starts.
type slot struct {
	fault   string
	at      time.Duration // the fault starts
	slotEnd time.Duration // the next fault starts (or the load ends)
	target  int           // engine index, for the engine and events faults
}

// newSchedule spreads faults evenly over the load after the warm-up: each gets an equal slot
// that must hold its downtime and the settle window after it. Engine-targeted faults take the
// engines in turn.
func newSchedule(faults []string, warmup, duration, downtime time.Duration) ([]slot, error) {
	if duration <= warmup {
		return nil, fmt.Errorf("-duration %v: want more than -warmup %v", duration, warmup)
	}
	if len(faults) == 0 {
		return nil, nil
	}
	each := (duration - warmup) / time.Duration(len(faults))
	if each < downtime+settleWindow+time.Second {
		return nil, fmt.Errorf("-duration %v leaves each of %d faults %v after the %v warm-up: want at least -downtime + %v + 1s",
			duration, len(faults), each, warmup, settleWindow)
	}
	s := make([]slot, len(faults))
	targeted := 0
	for i, f := range faults {
		s[i] = slot{fault: f, at: warmup + time.Duration(i)*each, slotEnd: warmup + time.Duration(i+1)*each}
		if f == faultEngine || f == faultEvents {
			s[i].target = targeted
			targeted++
		}
	}
	s[len(s)-1].slotEnd = duration
	return s, nil
}
