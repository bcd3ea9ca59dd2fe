//go:build !race

package prefixkey

const raceEnabled = false
