// Package run holds what the events transports share to run their goroutines: the Start/Close
// lifecycle of a consumer and the jittered exponential backoff between connection attempts. It is
// internal: a transport written elsewhere needs only the exported API of package events (Source,
// SourceSet, BackendWriter) and may run its goroutines as it likes.
package run

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"time"
)

// Errors of Lifecycle.Start; package events exports them as events.ErrClosed and
// events.ErrStarted.
var (
	ErrClosed  = errors.New("events: consumer closed")
	ErrStarted = errors.New("events: consumer already started")
)

// Lifecycle is the Start/Close state of a consumer: a context cancelled by Shutdown and the
// goroutines Shutdown waits for. Call Init before use; its methods are then safe for concurrent
// use.
type Lifecycle struct {
	mu      sync.Mutex
	started bool
	closed  bool
	ctx     context.Context
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

// Init creates the context that Shutdown cancels.
func (l *Lifecycle) Init() {
	l.ctx, l.cancel = context.WithCancel(context.Background())
}

// Context returns the context of the consumer's goroutines: cancelled by Shutdown.
func (l *Lifecycle) Context() context.Context { return l.ctx }

// Start runs launch (which starts the goroutines with Go) under the lock, so that a concurrent
// Shutdown waits for every goroutine launch started. It fails with ErrClosed after Shutdown and
// ErrStarted after a successful Start, and returns launch's error (launch must then have started
// nothing).
func (l *Lifecycle) Start(launch func() error) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.closed:
		return ErrClosed
	case l.started:
		return ErrStarted
	}
	if err := launch(); err != nil {
		return err
	}
	l.started = true
	return nil
}

// Go runs f as a goroutine Shutdown waits for.
func (l *Lifecycle) Go(f func()) {
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		f()
	}()
}

// Shutdown cancels the context and waits for the goroutines; it reports whether this call was
// the first.
func (l *Lifecycle) Shutdown() bool {
	l.mu.Lock()
	first := !l.closed
	l.closed = true
	l.mu.Unlock()
	l.cancel()
	l.wg.Wait()
	return first
}

// Backoff is an exponential backoff with ±20% jitter from Initial to Max. Not safe for
// concurrent use.
type Backoff struct {
	Initial, Max time.Duration
	cur          time.Duration
}

// Next returns the delay before the next attempt and doubles the base, up to Max.
func (b *Backoff) Next() time.Duration {
	if b.cur == 0 {
		b.cur = b.Initial
	} else {
		b.cur = min(b.cur*2, b.Max)
	}
	d := b.cur
	if j := int64(d) * 2 / 5; j > 0 {
		d += time.Duration(rand.Int64N(j+1) - j/2)
	}
	return min(max(d, time.Millisecond), b.Max)
}

// Reset makes the next delay the initial one again (after a successful connection).
func (b *Backoff) Reset() { b.cur = 0 }

// Sleep waits d or until ctx ends; it reports whether the full delay elapsed.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
