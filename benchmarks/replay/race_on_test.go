//go:build race

package replay

// raceEnabled: the race detector slows the simulations about tenfold; tests run fewer seeds.
const raceEnabled = true
