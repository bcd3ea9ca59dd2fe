//go:build race

package prefixkey

// raceEnabled: the race detector changes allocation counts and sizes.
const raceEnabled = true
