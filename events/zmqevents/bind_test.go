package zmqevents

import (
	"context"
	"net"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvroute/kvroute/events"
	"github.com/kvroute/kvroute/events/internal/eventstest"
	"github.com/kvroute/kvroute/internal/testenv"
)

func TestNewListeners(t *testing.T) {
	sink := eventstest.NewRecordingSink()
	for _, tc := range []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"listeners", Config{Sink: sink, Listeners: []Listener{
			{Bind: "tcp://*:5557", DefaultBackend: "a"}, {Bind: "tcp://*:5558", DefaultBackend: "b"}}}, true},
		{"bind and listeners", Config{Sink: sink, Bind: "tcp://*:5557", DefaultBackend: "a",
			Listeners: []Listener{{Bind: "tcp://*:5558", DefaultBackend: "b"}}}, true},
		{"free ports twice", Config{Sink: sink, Listeners: []Listener{
			{Bind: "tcp://127.0.0.1:0"}, {Bind: "tcp://127.0.0.1:0"}}}, true},
		{"same address twice", Config{Sink: sink, Listeners: []Listener{
			{Bind: "tcp://:5557", DefaultBackend: "a"}, {Bind: "tcp://127.0.0.1:5557", DefaultBackend: "b"}}}, false},
		{"bind's address again", Config{Sink: sink, Bind: "tcp://127.0.0.1:5557",
			Listeners: []Listener{{Bind: "tcp://127.0.0.1:5557"}}}, false},
		{"same ipc path twice", Config{Sink: sink, Listeners: []Listener{
			{Bind: "ipc:///tmp/kv.sock"}, {Bind: "ipc:///tmp/kv.sock"}}}, false},
		{"listener without address", Config{Sink: sink, Listeners: []Listener{{DefaultBackend: "a"}}}, false},
		{"listener with a bad address", Config{Sink: sink, Listeners: []Listener{{Bind: "http://h:1"}}}, false},
		{"listener with an empty topic backend", Config{Sink: sink, Listeners: []Listener{
			{Bind: "tcp://*:1", TopicBackend: map[string]string{"t": ""}}}}, false},
		{"bind's options without bind", Config{Sink: sink, DefaultBackend: "a",
			Listeners: []Listener{{Bind: "tcp://*:5557"}}}, false},
		{"listeners and endpoints", Config{Sink: sink, Endpoints: []Endpoint{{Backend: "a", Endpoint: "tcp://h:1"}},
			Listeners: []Listener{{Bind: "tcp://*:5557"}}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := New(tc.cfg)
			if tc.ok {
				require.NoError(t, err)
				require.NoError(t, c.Close())
			} else {
				require.ErrorIs(t, err, events.ErrInvalidConfig)
			}
		})
	}
}

// One bound address per engine: engines that keep vLLM's default topic ("", which names no pod)
// each connect to an address of their own, whose DefaultBackend is theirs. Each address's events
// land under its backend only, and each address reports its own source, connected.
func TestZMQBindOneAddressPerEngine(t *testing.T) {
	check := CheckGoroutines(t)
	sink := eventstest.NewRecordingSink()
	c, err := New(Config{Sink: sink, Listeners: []Listener{
		{Bind: "tcp://127.0.0.1:0", DefaultBackend: "vllm-a", Model: "m-a"},
		{Bind: "tcp://127.0.0.1:0", DefaultBackend: "vllm-b", Model: "m-b"},
	}})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() }) // idempotent: the test closes it first
	require.Nil(t, c.Addrs(), "no address before Start")
	require.NoError(t, c.Start(context.Background()))
	addrs := c.Addrs()
	require.Len(t, addrs, 2)
	require.NotEqual(t, addrs[0].String(), addrs[1].String())
	assert.Equal(t, addrs[0], c.Addr())
	eps := []string{"tcp://" + addrs[0].String(), "tcp://" + addrs[1].String()}

	pa := NewFakePublisher(t, FakePublisherConfig{Connect: eps[0]})
	pb := NewFakePublisher(t, FakePublisherConfig{Connect: eps[1], FirstSeq: 50})
	pa.WaitSubscribed()
	pb.WaitSubscribed()
	for i := range 3 {
		pa.Publish(stored(uint64(i)))
		pb.Publish(stored(uint64(100 + i)))
	}
	pb.Publish(stored(103))
	require.Eventually(t, func() bool {
		return len(sink.Applied("vllm-a")) == 3 && len(sink.Applied("vllm-b")) == 4
	}, waitFor, tick)
	assert.Equal(t, []int64{0, 1, 2}, sink.Seqs("vllm-a"))
	assert.Equal(t, []int64{50, 51, 52, 53}, sink.Seqs("vllm-b"))
	for _, b := range sink.Applied("vllm-a") {
		assert.Equal(t, "m-a", b.Model)
	}
	for _, b := range sink.Applied("vllm-b") {
		assert.Equal(t, "m-b", b.Model)
	}
	assert.Zero(t, sink.Clears("vllm-a"))
	assert.Zero(t, sink.Clears("vllm-b"))

	st := c.Status()
	require.Len(t, st, 2, "one source per address and backend: %+v", st)
	byBackend := map[string]events.SourceStatus{}
	for _, s := range st {
		byBackend[s.Backend] = s
	}
	for i, b := range []string{"vllm-a", "vllm-b"} {
		s := byBackend[b]
		assert.True(t, s.Connection.Connected, b)
		assert.Equal(t, eps[i], s.Endpoint, b)
		assert.Equal(t, uint64(3+i), s.Events.Processed, b)
	}
	ls := c.Listeners()
	require.Len(t, ls, 2)
	for i, l := range ls {
		assert.True(t, l.Connection.Connected, "listener %d", i)
		assert.Zero(t, l.Messages.Unplaced+l.Messages.Malformed, "listener %d", i)
	}

	// Engine b goes away: its backend alone is disconnected and cleared.
	pb.Stop()
	require.Eventually(t, func() bool { return !eventstest.StatusOf(t, c, "vllm-b").Connection.Connected }, waitFor, tick)
	require.Eventually(t, func() bool { return sink.Clears("vllm-b") == 1 }, waitFor, tick)
	assert.True(t, eventstest.StatusOf(t, c, "vllm-a").Connection.Connected)
	assert.Zero(t, sink.Clears("vllm-a"))

	require.NoError(t, c.Close())
	for _, l := range c.Listeners() {
		assert.Equal(t, events.StateClosed, l.Connection.State)
	}
	pa.Close()
	pb.Close()
	check()
}

// One bound address per data-parallel rank: vLLM adds the rank to the port an engine connects
// to, so the ranks of every engine arrive on different addresses with the same kv@<pod>@<model>
// topic. The consumer's one worker per backend keeps each backend's batches in order: the
// interleaved ranks are neither gaps nor restarts.
func TestZMQBindOneAddressPerRank(t *testing.T) {
	sink := eventstest.NewRecordingSink()
	pods := []string{"pod-a", "pod-b"}
	c := startZMQ(t, Config{Sink: sink, Listeners: []Listener{
		{Bind: "tcp://127.0.0.1:0", Backends: pods},
		{Bind: "tcp://127.0.0.1:0", Backends: pods},
	}})
	addrs := c.Addrs()
	require.Len(t, addrs, 2)
	r0, r1 := 0, 1
	pubs := map[string][2]*FakePublisher{}
	for _, pod := range pods {
		topic := "kv@" + pod + "@llama"
		pubs[pod] = [2]*FakePublisher{
			NewFakePublisher(t, FakePublisherConfig{Topic: topic, Connect: "tcp://" + addrs[0].String(), Rank: &r0}),
			NewFakePublisher(t, FakePublisherConfig{Topic: topic, Connect: "tcp://" + addrs[1].String(), Rank: &r1, FirstSeq: 500}),
		}
		pubs[pod][0].WaitSubscribed()
		pubs[pod][1].WaitSubscribed()
	}
	for i := range 4 {
		for _, pod := range pods {
			pubs[pod][0].Publish(stored(uint64(i)))
			pubs[pod][1].Publish(stored(uint64(1000 + i)))
		}
	}
	for _, pod := range pods {
		require.Eventually(t, func() bool { return len(sink.Applied(pod)) == 8 }, waitFor, tick, pod)
		assert.Zero(t, sink.Clears(pod), "interleaved ranks on two addresses are neither gaps nor restarts")
	}
	assert.Len(t, c.Status(), 4, "one source per address and backend")
	for _, s := range c.Status() {
		assert.True(t, s.Connection.Connected, "%s on %s", s.Backend, s.Endpoint)
		assert.Zero(t, s.Sequence.Gaps, "%s on %s", s.Backend, s.Endpoint)
	}

	// Rank 1 of pod-a goes away: pod-a is cleared, and rank 0 goes on with its sequence.
	pubs["pod-a"][1].Stop()
	require.Eventually(t, func() bool { return sink.Clears("pod-a") == 1 }, waitFor, tick)
	pubs["pod-a"][0].Publish(stored(4))
	require.Eventually(t, func() bool { return len(sink.Applied("pod-a")) == 9 }, waitFor, tick)
	assert.Equal(t, 1, sink.Clears("pod-a"))
	assert.Zero(t, sink.Clears("pod-b"))
}

// Each address places its messages by its own rules: a topic one maps is not mapped on another,
// a pod one accepts is dropped by another that does not list it, and the messages an address
// cannot place are counted on its own status.
func TestZMQBindRulesPerAddress(t *testing.T) {
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink,
		Bind: "tcp://127.0.0.1:0", TopicBackend: map[string]string{"engine-x": "vllm-x"}, Backends: []string{"pod-a"},
		Listeners: []Listener{{Bind: "tcp://127.0.0.1:0", DefaultBackend: "vllm-y"}}})
	addrs := c.Addrs()
	require.Len(t, addrs, 2)
	first, second := "tcp://"+addrs[0].String(), "tcp://"+addrs[1].String()
	pubs := []*FakePublisher{
		NewFakePublisher(t, FakePublisherConfig{Topic: "engine-x", Connect: first}),    // → vllm-x
		NewFakePublisher(t, FakePublisherConfig{Topic: "kv@pod-a@m", Connect: first}),  // → pod-a
		NewFakePublisher(t, FakePublisherConfig{Topic: "kv@pod-z@m", Connect: first}),  // unknown pod: dropped
		NewFakePublisher(t, FakePublisherConfig{Topic: "engine-x", Connect: second}),   // → vllm-y, not vllm-x
		NewFakePublisher(t, FakePublisherConfig{Topic: "kv@pod-a@m", Connect: second}), // → vllm-y, not pod-a
	}
	for _, p := range pubs {
		p.WaitSubscribed()
	}
	for _, p := range pubs {
		p.Publish(stored(1))
	}
	require.Eventually(t, func() bool {
		return len(sink.Applied("vllm-x")) == 1 && len(sink.Applied("pod-a")) == 1 && len(sink.Applied("vllm-y")) == 2
	}, waitFor, tick)
	require.Eventually(t, func() bool { return c.Listeners()[0].Messages.Unplaced == 1 }, waitFor, tick)
	assert.Empty(t, sink.Applied("pod-z"), "a pod the address does not accept became a backend")
	ls := c.Listeners()
	assert.Contains(t, ls[0].LastError, "maps to no backend")
	assert.Zero(t, ls[1].Messages.Unplaced)
	for _, s := range c.Status() {
		want := first
		if s.Backend == "vllm-y" {
			want = second
		}
		assert.Equal(t, want, s.Endpoint, s.Backend)
	}
	assert.Len(t, c.Status(), 3)
}

// MaxTopics counts the topics of every address together.
func TestZMQBindMaxTopicsAcrossAddresses(t *testing.T) {
	sink := eventstest.NewRecordingSink()
	c := startZMQ(t, Config{Sink: sink, MaxTopics: 1, Listeners: []Listener{
		{Bind: "tcp://127.0.0.1:0", DefaultBackend: "a"}, {Bind: "tcp://127.0.0.1:0", DefaultBackend: "b"}}})
	addrs := c.Addrs()
	pa := NewFakePublisher(t, FakePublisherConfig{Topic: "t", Connect: "tcp://" + addrs[0].String()})
	pa.WaitSubscribed()
	pa.Publish(stored(1))
	require.Eventually(t, func() bool { return len(sink.Applied("a")) == 1 }, waitFor, tick)
	pb := NewFakePublisher(t, FakePublisherConfig{Topic: "t", Connect: "tcp://" + addrs[1].String()})
	pb.WaitSubscribed()
	pb.Publish(stored(1))
	require.Eventually(t, func() bool { return c.Listeners()[1].Messages.Unplaced == 1 }, waitFor, tick)
	assert.Empty(t, sink.Applied("b"))
}

// A bind that fails on a later address releases the addresses bound before it, and Start can be
// tried again.
func TestZMQBindErrorReleasesEarlierAddresses(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer busy.Close()
	free := testenv.FreePort(t)
	first := "tcp://127.0.0.1:" + strconv.Itoa(free)
	c, err := New(Config{Sink: eventstest.NewRecordingSink(), Listeners: []Listener{
		{Bind: first, DefaultBackend: "a"}, {Bind: "tcp://" + busy.Addr().String(), DefaultBackend: "b"}}})
	require.NoError(t, err)
	defer c.Close()
	require.ErrorContains(t, c.Start(context.Background()), busy.Addr().String())
	assert.Nil(t, c.Addrs())
	ls := c.Listeners()
	require.Len(t, ls, 2)
	assert.False(t, ls[0].Connection.Connected)
	assert.False(t, ls[1].Connection.Connected)
	assert.NotEmpty(t, ls[1].LastError)

	// The first address was released.
	ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(free))
	require.NoError(t, err, "the first address is still bound")
	require.NoError(t, ln.Close())

	require.NoError(t, busy.Close())
	require.NoError(t, c.Start(context.Background()))
	for i, l := range c.Listeners() {
		assert.True(t, l.Connection.Connected, "listener %d", i)
	}
	assert.Len(t, c.Addrs(), 2)
}
