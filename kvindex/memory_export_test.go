package kvindex

// NewMemorySharedEngines is NewMemory with every backend on the shared engine-hash map from its
// first event (see memory_shared.go) instead of once its engine hashes are seen to agree with
// other backends': the conformance suite runs against both maps.
func NewMemorySharedEngines(cfg MemoryConfig) (*MemoryIndex, error) {
	m, err := NewMemory(cfg)
	if err != nil {
		return nil, err
	}
	m.reg.mu.Lock()
	m.reg.shareAll = true
	m.reg.mu.Unlock()
	return m, nil
}
