package s3store

// ReaperIdle reports whether the background reaper has nothing queued and no deletion in flight
// (its last DeleteObject answered). A test that waits for an expired object to vanish waits for
// this too: the server may still be tidying up after the deletion (versitygw's posix backend
// removes the emptied key-prefix directories) when the object already reads as gone, and a Set
// racing that tidy-up fails.
func (s *Store) ReaperIdle() bool {
	s.reapMu.Lock()
	defer s.reapMu.Unlock()
	return s.reapCur == "" && len(s.reapQueue) == 0
}
