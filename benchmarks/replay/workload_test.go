package replay

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestSharedPrefix(t *testing.T) {
	w, err := SharedPrefix(SharedPrefixConfig{Groups: 6, UsersPerGroup: 3, PrefixTokens: 600, QuestionTokens: 120,
		OutputTokens: 7, Requests: 500, Seed: 4})
	require.NoError(t, err)
	require.Len(t, w.Requests, 500)
	prefixes, prompts := map[uint64]bool{}, map[[2]uint64]bool{}
	usersOf := map[uint64]map[uint64]bool{}
	for i, r := range w.Requests {
		require.Len(t, r.Segments, 2)
		require.Equal(t, 600, r.Segments[0].Tokens)
		require.Equal(t, 120, r.Segments[1].Tokens)
		require.Equal(t, 7, r.OutputTokens)
		require.NotEqual(t, r.Segments[0].ID, r.Segments[1].ID)
		if i > 0 {
			require.GreaterOrEqual(t, r.Arrival, w.Requests[i-1].Arrival)
		}
		prefixes[r.Segments[0].ID] = true
		prompts[[2]uint64{r.Segments[0].ID, r.Segments[1].ID}] = true
		if usersOf[r.Segments[0].ID] == nil {
			usersOf[r.Segments[0].ID] = map[uint64]bool{}
		}
		usersOf[r.Segments[0].ID][r.Segments[1].ID] = true
	}
	require.Len(t, prefixes, 6, "every group drawn in 500 requests")
	require.Len(t, prompts, 18, "one fixed prompt per user")
	for _, u := range usersOf {
		require.Len(t, u, 3)
	}
	again, err := SharedPrefix(SharedPrefixConfig{Groups: 6, UsersPerGroup: 3, PrefixTokens: 600, QuestionTokens: 120,
		OutputTokens: 7, Requests: 500, Seed: 4})
	require.NoError(t, err)
	require.Equal(t, w, again, "deterministic for a seed")

	_, err = SharedPrefix(SharedPrefixConfig{Groups: -1})
	require.ErrorIs(t, err, ErrInvalidConfig)
}

func TestMultiTurn(t *testing.T) {
	w, err := MultiTurn(MultiTurnConfig{Conversations: 20, Turns: 4, SystemPrompts: 2, SystemTokens: 100,
		UserTokens: 40, OutputTokens: 30, Seed: 9})
	require.NoError(t, err)
	require.Len(t, w.Requests, 80)
	require.True(t, slices.IsSortedFunc(w.Requests, func(a, b Request) int { return int(a.Arrival - b.Arrival) }))
	// Group by conversation (its first user segment), in turn order: each prompt extends the
	// previous turn's prompt by that turn's answer and a new user message.
	byConv := map[uint64][]Request{}
	systems := map[uint64]bool{}
	for _, r := range w.Requests {
		systems[r.Segments[0].ID] = true
		byConv[r.Segments[1].ID] = append(byConv[r.Segments[1].ID], r)
	}
	require.Len(t, byConv, 20)
	require.LessOrEqual(t, len(systems), 2)
	for _, turns := range byConv {
		slices.SortFunc(turns, func(a, b Request) int { return len(a.Segments) - len(b.Segments) })
		require.Len(t, turns, 4)
		for k := 1; k < len(turns); k++ {
			prev, cur := turns[k-1], turns[k]
			require.Len(t, cur.Segments, len(prev.Segments)+2)
			require.Equal(t, prev.Segments, cur.Segments[:len(prev.Segments)])
			require.Equal(t, 30, cur.Segments[len(prev.Segments)].Tokens, "the previous answer")
			require.Greater(t, cur.Arrival, prev.Arrival)
		}
	}
}

func TestTokens(t *testing.T) {
	a := Request{Segments: []Segment{{1, 40}, {2, 30}}}
	b := Request{Segments: []Segment{{1, 40}, {3, 30}}}
	c := Request{Segments: []Segment{{1, 20}}}
	ta, tb, tc := appendTokens(nil, &a, 5), appendTokens(nil, &b, 5), appendTokens(nil, &c, 5)
	require.Len(t, ta, 70)
	require.Equal(t, ta[:40], tb[:40], "equal segments, equal tokens")
	require.NotEqual(t, ta[40:], tb[40:])
	require.Equal(t, ta[:20], tc, "a partial segment is a prefix of the whole")
	require.NotEqual(t, ta, appendTokens(nil, &a, 6), "the seed salts the tokens")
	for _, tok := range ta {
		require.Less(t, tok, uint32(vocab))
	}
	require.Equal(t, anchorText(&a, 5), anchorText(&b, 5), "same first segment, same system prompt")
	require.NotEqual(t, anchorText(&a, 5), anchorText(&Request{Segments: []Segment{{2, 40}}}, 5))

	common := (&Workload{Requests: []Request{a, b}}).WithCommonPrefix(512)
	require.Equal(t, anchorText(&common.Requests[0], 1), anchorText(&common.Requests[1], 1))
	require.Equal(t, 512+70, common.Requests[0].InputTokens())
	require.Equal(t, 70, a.InputTokens(), "the original is left alone")
}
