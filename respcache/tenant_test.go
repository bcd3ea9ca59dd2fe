package respcache

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/quick"

	"github.com/kvroute/kvroute/prefixkey"
)

// tenantRequest returns a request carrying the given header values (pairs of name, value; a name
// may repeat).
func tenantRequest(hdr ...string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Add(hdr[i], hdr[i+1])
	}
	return r
}

// TestTenantVectors pins the tenant digests (computed independently from the documented layout).
func TestTenantVectors(t *testing.T) {
	xTenant := HeaderTenant("x-tenant-id") // canonicalised: the same as "X-Tenant-Id"
	for _, tc := range []struct {
		name string
		fn   func(*http.Request) string
		hdr  []string
		want string
	}{
		{"credential/none", CredentialTenant, nil, ""},
		{"credential/other headers only", CredentialTenant, []string{"Cookie", "s=1", "X-Tenant-Id", "acme"}, ""},
		{"credential/authorization", CredentialTenant, []string{"Authorization", "Bearer sk-alice"},
			"05d36321b1ac1fbc863184483bc3433df14bc7425fbb75d14ee0dc5644c04a0d"},
		{"credential/x-api-key", CredentialTenant, []string{"x-api-key", "sk-ant-bob"},
			"e9a957a1fbc0a89f827cf9ee8b81ab80fa87e194823adde2cb13130336d6b396"},
		{"credential/both", CredentialTenant, []string{"Authorization", "Bearer none", "X-API-KEY", "sk-ant-bob"},
			"29be1b69b49dd097d297fbb0a3da0a7bddf70d0a2cbc82136b69ec16f41b9bc9"},
		// Azure OpenAI's api-key (issue 28): its own list, appended only when present, so that the
		// vectors above (kvroute 0.1.0's) are unchanged.
		{"credential/api-key", CredentialTenant, []string{"api-key", "azure-key-1"},
			"49e5dc2ddf776a89049b5c494c3e496a1925be385e532e2dd4fba78fbb33b6d7"},
		{"credential/all three", CredentialTenant, []string{"Authorization", "Bearer none", "X-Api-Key", "sk-ant-bob",
			"Api-Key", "azure-key-1", "api-key", "azure-key-2"},
			"aa6ba87bf743e1e6a67a3147eb08100a58eb6f647190278bbb63b32d8e9332ac"},
		{"header/none", xTenant, []string{"Authorization", "Bearer sk-alice"}, ""},
		{"header/one", xTenant, []string{"X-Tenant-Id", "acme"},
			"5f3abc6b9ef1f4b2720b784c859a7ea8233a907fe55c586c9deebd96ec295f30"},
		{"header/two values", xTenant, []string{"X-Tenant-Id", "acme", "x-tenant-id", "globex"},
			"b73510cdb3afe265e90237c405160ebcdc522496eb1fb9fae0a9bb77c9e25720"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.fn(tenantRequest(tc.hdr...)); got != tc.want {
				t.Errorf("tenant = %q, want %q", got, tc.want)
			}
		})
	}
}

// TestTenantSeparations lists credentials that look alike and must still be different tenants.
func TestTenantSeparations(t *testing.T) {
	xTenant := HeaderTenant("X-Tenant-Id")
	for _, tc := range []struct {
		name   string
		fa, fb func(*http.Request) string
		a, b   []string
	}{
		{"authorization vs x-api-key of the same value", CredentialTenant, CredentialTenant,
			[]string{"Authorization", "k"}, []string{"X-Api-Key", "k"}},
		{"same placeholder authorization, different x-api-key", CredentialTenant, CredentialTenant,
			[]string{"Authorization", "Bearer none", "X-Api-Key", "a"}, []string{"Authorization", "Bearer none", "X-Api-Key", "b"}},
		{"value split across two values", CredentialTenant, CredentialTenant,
			[]string{"Authorization", "ab"}, []string{"Authorization", "a", "Authorization", "b"}},
		{"value moved between headers", CredentialTenant, CredentialTenant,
			[]string{"Authorization", "a", "X-Api-Key", "b"}, []string{"Authorization", "ab"}},
		{"empty credential vs none", CredentialTenant, CredentialTenant,
			[]string{"Authorization", ""}, nil},
		{"two api-keys", CredentialTenant, CredentialTenant,
			[]string{"api-key", "azure-a"}, []string{"api-key", "azure-b"}},
		{"api-key vs none", CredentialTenant, CredentialTenant,
			[]string{"api-key", "azure-a"}, nil},
		{"api-key vs x-api-key of the same value", CredentialTenant, CredentialTenant,
			[]string{"api-key", "k"}, []string{"X-Api-Key", "k"}},
		{"placeholder authorization, with and without an api-key", CredentialTenant, CredentialTenant,
			[]string{"Authorization", "Bearer none", "api-key", "azure-a"}, []string{"Authorization", "Bearer none"}},
		{"credential vs tenant header of the same value", CredentialTenant, xTenant,
			[]string{"Authorization", "acme"}, []string{"X-Tenant-Id", "acme"}},
		{"two tenant headers of the same value", HeaderTenant("X-Org"), xTenant,
			[]string{"X-Org", "acme"}, []string{"X-Tenant-Id", "acme"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ta, tb := tc.fa(tenantRequest(tc.a...)), tc.fb(tenantRequest(tc.b...))
			if ta == tb {
				t.Fatalf("both are tenant %q", ta)
			}
		})
	}
}

// TestTenantNeverHoldsTheSecret: the tenant is a digest, never the credential or a part of it.
func TestTenantNeverHoldsTheSecret(t *testing.T) {
	const secret = "sk-proj-0123456789abcdef"
	for _, tn := range []string{
		CredentialTenant(tenantRequest("Authorization", "Bearer "+secret)),
		CredentialTenant(tenantRequest("X-Api-Key", secret)),
		HeaderTenant("Authorization")(tenantRequest("Authorization", "Bearer "+secret)),
	} {
		if len(tn) != 64 || strings.Trim(tn, "0123456789abcdef") != "" || strings.Contains(tn, secret) {
			t.Errorf("tenant %q is not a bare SHA-256 hex digest", tn)
		}
	}
}

func TestHeaderTenantPanicsOnBadName(t *testing.T) {
	for _, name := range []string{"", "X Tenant", "X-Tenant:", "Ténant", "a\nb"} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("HeaderTenant(%q) did not panic", name)
				}
			}()
			HeaderTenant(name)
		}()
	}
	HeaderTenant("X-Tenant_Id.v2") // valid token characters
}

// callerCreds are the credential headers of one caller, generated by testing/quick.
type callerCreds struct {
	Auth, APIKey, AzureKey []string
}

// Generate implements quick.Generator: few, short values from a small alphabet, so that equal
// and near-equal credentials (the interesting cases) come up often.
func (callerCreds) Generate(rng *rand.Rand, _ int) reflect.Value {
	vals := func() []string {
		var vs []string
		for range rng.IntN(3) {
			b := make([]byte, rng.IntN(4))
			for i := range b {
				b[i] = "ab "[rng.IntN(3)]
			}
			vs = append(vs, string(b))
		}
		return vs
	}
	return reflect.ValueOf(callerCreds{Auth: vals(), APIKey: vals(), AzureKey: vals()})
}

func (c callerCreds) request() *http.Request {
	r := tenantRequest()
	for _, v := range c.Auth {
		r.Header.Add("Authorization", v)
	}
	for _, v := range c.APIKey {
		r.Header.Add("X-Api-Key", v)
	}
	for _, v := range c.AzureKey {
		r.Header.Add("Api-Key", v)
	}
	return r
}

// TestTenantKeysNeverCollide is the property behind tenant isolation: for any request, two
// callers get the same cache key exactly when they present the same credentials (the same
// Authorization, X-Api-Key and api-key values, in the same order), and the same tenant header exactly when
// they carry the same values of it.
func TestTenantKeysNeverCollide(t *testing.T) {
	xTenant := HeaderTenant("X-Tenant-Id")
	prop := func(seed uint64, a, b callerCreds) bool {
		req := randRequest(rand.New(rand.NewPCG(seed, 0)))
		keyAs := func(c callerCreds, tenant func(*http.Request) string) Key {
			r := *req
			r.Tenant = tenant(c.request())
			return KeyOf(&r)
		}
		same := slices.Equal(a.Auth, b.Auth) && slices.Equal(a.APIKey, b.APIKey) && slices.Equal(a.AzureKey, b.AzureKey)
		if (keyAs(a, CredentialTenant) == keyAs(b, CredentialTenant)) != same {
			t.Logf("credentials %q and %q", a, b)
			return false
		}
		// The Authorization values in the tenant header instead.
		ha, hb := tenantRequest(), tenantRequest()
		for _, v := range a.Auth {
			ha.Header.Add("X-Tenant-Id", v)
		}
		for _, v := range b.Auth {
			hb.Header.Add("X-Tenant-Id", v)
		}
		ka, kb := *req, *req
		ka.Tenant, kb.Tenant = xTenant(ha), xTenant(hb)
		if (KeyOf(&ka) == KeyOf(&kb)) != slices.Equal(a.Auth, b.Auth) {
			t.Logf("tenant header values %q and %q", a.Auth, b.Auth)
			return false
		}
		// A credential tenant and a header tenant never share a key, except both anonymous.
		if len(a.Auth) > 0 && KeyOf(&ka) == keyAs(a, CredentialTenant) {
			t.Logf("header tenant %q equals a credential tenant", a.Auth)
			return false
		}
		return true
	}
	if err := quick.Check(prop, &quick.Config{MaxCount: 2000}); err != nil {
		t.Fatal(err)
	}
}

// tenantEcho answers every request with a body naming the credential it saw, and counts calls.
type tenantEcho struct{ calls atomic.Int64 }

func (h *tenantEcho) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.calls.Add(1)
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"for":%q}`, r.Header.Get("Authorization")+r.Header.Get("X-Api-Key")+r.Header.Get("X-Tenant-Id"))
}

// TestMiddlewareTenants runs request sequences through a Cache and checks each X-Cache: by
// default the caller's credential decides the tenant.
func TestMiddlewareTenants(t *testing.T) {
	body := mwChat("same prompt", `"temperature":0`)
	type step struct {
		hdr  []string
		want string
	}
	for _, tc := range []struct {
		name  string
		cfg   Config
		steps []step
	}{
		{"two bearer tokens", Config{}, []step{
			{[]string{"Authorization", "Bearer alice"}, XCacheMiss},
			{[]string{"Authorization", "Bearer bob"}, XCacheMiss},
			{[]string{"Authorization", "Bearer alice"}, XCacheHit},
			{[]string{"Authorization", "Bearer bob"}, XCacheHit},
		}},
		{"same bearer token", Config{}, []step{
			{[]string{"Authorization", "Bearer alice"}, XCacheMiss},
			{[]string{"Authorization", "Bearer alice"}, XCacheHit},
		}},
		{"two x-api-keys", Config{}, []step{
			{[]string{"X-Api-Key", "sk-ant-alice"}, XCacheMiss},
			{[]string{"X-Api-Key", "sk-ant-bob"}, XCacheMiss},
			{[]string{"X-Api-Key", "sk-ant-alice"}, XCacheHit},
		}},
		{"authorization vs x-api-key", Config{}, []step{
			{[]string{"Authorization", "k"}, XCacheMiss},
			{[]string{"X-Api-Key", "k"}, XCacheMiss},
		}},
		{"two azure api-keys, and none", Config{}, []step{ // issue 28: they shared the anonymous tenant
			{[]string{"api-key", "azure-alice"}, XCacheMiss},
			{[]string{"api-key", "azure-bob"}, XCacheMiss},
			{nil, XCacheMiss},
			{[]string{"Api-Key", "azure-alice"}, XCacheHit},
		}},
		{"credential vs anonymous", Config{}, []step{
			{[]string{"Authorization", "Bearer alice"}, XCacheMiss},
			{nil, XCacheMiss},
			{nil, XCacheHit}, // anonymous callers share one tenant
		}},
		{"shared across tenants", Config{SharedAcrossTenants: true}, []step{
			{[]string{"Authorization", "Bearer alice"}, XCacheMiss},
			{[]string{"Authorization", "Bearer bob"}, XCacheHit},
			{[]string{"X-Api-Key", "sk-ant-carol"}, XCacheHit},
			{nil, XCacheHit},
		}},
		{"tenant header decides", Config{Tenant: HeaderTenant("X-Tenant-Id")}, []step{
			{[]string{"X-Tenant-Id", "acme", "Authorization", "Bearer alice"}, XCacheMiss},
			{[]string{"X-Tenant-Id", "acme", "Authorization", "Bearer bob"}, XCacheHit},
			{[]string{"X-Tenant-Id", "globex", "Authorization", "Bearer alice"}, XCacheMiss},
			{[]string{"Authorization", "Bearer alice"}, XCacheMiss}, // no header: anonymous
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			next := &tenantEcho{}
			h := mwNew(t, tc.cfg).Middleware(next)
			misses := 0
			for i, s := range tc.steps {
				w := mwDo(h, "/v1/chat/completions", body, s.hdr...)
				if got := w.Header().Get(HeaderXCache); got != s.want {
					t.Fatalf("step %d (%q): X-Cache %s, want %s", i, s.hdr, got, s.want)
				}
				if s.want == XCacheMiss {
					misses++
				}
			}
			if n := next.calls.Load(); n != int64(misses) {
				t.Fatalf("backend called %d times, want %d", n, misses)
			}
		})
	}
}

// TestMiddlewareTenantHitIsOwn: a HIT replays the response recorded for the same tenant.
func TestMiddlewareTenantHitIsOwn(t *testing.T) {
	h := mwNew(t, Config{}).Middleware(&tenantEcho{})
	body := mwChat("whose?", `"temperature":0`)
	for range 2 {
		for _, who := range []string{"alice", "bob"} {
			w := mwDo(h, "/v1/chat/completions", body, "Authorization", who)
			if want := `{"for":"` + who + `"}`; w.Body.String() != want {
				t.Fatalf("%s got %s (X-Cache %s), want %s", who, w.Body, w.Header().Get(HeaderXCache), want)
			}
		}
	}
}

// TestCoalesceSeparatesTenants: concurrent identical requests of two tenants make two backend
// calls, one per tenant, and every request receives its own tenant's response.
func TestCoalesceSeparatesTenants(t *testing.T) {
	const perTenant = 5
	c := mwNew(t, Config{})
	release := make(chan struct{})
	var calls atomic.Int64
	h := c.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		<-release
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"for":%q}`, r.Header.Get("Authorization"))
	}))
	body := mwChat("coalesce per tenant", `"temperature":0`)
	tenants := []string{"Bearer alice", "Bearer bob"}
	results := make([][]*httptest.ResponseRecorder, len(tenants))
	var wg sync.WaitGroup
	for i, auth := range tenants {
		results[i] = make([]*httptest.ResponseRecorder, perTenant)
		for j := range perTenant {
			wg.Go(func() { results[i][j] = mwDo(h, "/v1/chat/completions", body, "Authorization", auth) })
		}
	}
	// Both tenants' leaders are in the backend and every other request waits on one of them.
	mwWaitFollowers(t, c, len(tenants)*(perTenant-1))
	c.mu.Lock()
	flights := len(c.flights)
	c.mu.Unlock()
	if flights != len(tenants) {
		t.Errorf("%d flights, want one per tenant", flights)
	}
	close(release)
	wg.Wait()
	if n := calls.Load(); n != int64(len(tenants)) {
		t.Fatalf("backend called %d times, want %d", n, len(tenants))
	}
	for i, auth := range tenants {
		for j, w := range results[i] {
			if want := `{"for":"` + auth + `"}`; w.Body.String() != want {
				t.Fatalf("tenant %q request %d got %s (X-Cache %s), want %s", auth, j, w.Body, w.Header().Get(HeaderXCache), want)
			}
		}
	}
	st := c.Stats(context.Background())
	if st.Coalesced != uint64(len(tenants)*(perTenant-1)) || st.Entries != len(tenants) {
		t.Fatalf("coalesced %d entries %d", st.Coalesced, st.Entries)
	}
}

// TestCustomTenantReplacesParsed: Config.Tenant's result replaces what a custom Parse put in
// Request.Tenant, and a nil Tenant still isolates callers.
func TestCustomTenantReplacesParsed(t *testing.T) {
	parse := func(path string, body []byte) (*prefixkey.Request, error) {
		r, err := DefaultParse(path, body)
		if r != nil {
			r.Tenant = "from-parse"
		}
		return r, err
	}
	h := mwNew(t, Config{Parse: parse}).Middleware(&tenantEcho{})
	body := mwChat("p", `"temperature":0`)
	mwWantXCache(t, mwDo(h, "/v1/chat/completions", body, "Authorization", "a"), XCacheMiss)
	mwWantXCache(t, mwDo(h, "/v1/chat/completions", body, "Authorization", "b"), XCacheMiss)
}

func TestNewRejectsTenantWithShared(t *testing.T) {
	_, err := New(Config{Tenant: HeaderTenant("X-Tenant-Id"), SharedAcrossTenants: true})
	if !errors.Is(err, ErrInvalidConfig) {
		t.Fatalf("err %v, want ErrInvalidConfig", err)
	}
}

// TestAbsentTemperatureBypasses: by default a request without a temperature samples (the
// providers' default is 1) and is not cached; AssumeGreedyDefault caches it.
func TestAbsentTemperatureBypasses(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cfg   Config
		path  string
		body  []byte
		wants []string
	}{
		{"openai", Config{}, "/v1/chat/completions", mwChat("t?"), []string{XCacheBypass, XCacheBypass}},
		{"anthropic", Config{}, "/v1/messages", mwAnthropic("t?"), []string{XCacheBypass, XCacheBypass}},
		{"openai/seed only", Config{}, "/v1/chat/completions", mwChat("t?", `"seed":1`), []string{XCacheBypass, XCacheBypass}},
		{"openai/explicit 0", Config{}, "/v1/chat/completions", mwChat("t?", `"temperature":0`), []string{XCacheMiss, XCacheHit}},
		{"anthropic/explicit 0", Config{}, "/v1/messages", mwAnthropic("t?", `"temperature":0`), []string{XCacheMiss, XCacheHit}},
		{"openai/greedy default", Config{AssumeGreedyDefault: true}, "/v1/chat/completions", mwChat("t?"), []string{XCacheMiss, XCacheHit}},
		{"anthropic/greedy default", Config{AssumeGreedyDefault: true}, "/v1/messages", mwAnthropic("t?"), []string{XCacheMiss, XCacheHit}},
		{"greedy default/n 2", Config{AssumeGreedyDefault: true}, "/v1/chat/completions", mwChat("t?", `"n":2`), []string{XCacheBypass, XCacheBypass}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := mwNew(t, tc.cfg).Middleware(&tenantEcho{})
			for i, want := range tc.wants {
				if got := mwDo(h, tc.path, tc.body).Header().Get(HeaderXCache); got != want {
					t.Fatalf("request %d: X-Cache %s, want %s", i, got, want)
				}
			}
		})
	}
}

// BenchmarkCredentialTenant: the cost the default tenant adds to every eligible request.
func BenchmarkCredentialTenant(b *testing.B) {
	r := tenantRequest("Authorization", "Bearer sk-proj-"+strings.Repeat("x", 48))
	b.ReportAllocs()
	for b.Loop() {
		_ = CredentialTenant(r)
	}
}
