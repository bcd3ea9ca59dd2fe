package natstest

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

func TestRestartKeepsURL(t *testing.T) {
	s := Start(t)
	nc, err := nats.Connect(s.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	s.Restart()
	deadline := time.Now().Add(10 * time.Second)
	for !nc.IsConnected() {
		if time.Now().After(deadline) {
			t.Fatal("the client did not reconnect after the restart")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
