//go:build race

package natsync

// raceEnabled reports whether the tests run under the race detector, which allocates on its own
// and so invalidates testing.AllocsPerRun assertions.
const raceEnabled = true
