// Package workspace holds one test: it runs the tests of the workspace's other modules, so that
// "go test ./..." at the repository root, which only names the library module's packages, tests
// every module of the checkout, as the README promises.
package workspace
