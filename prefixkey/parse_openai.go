package prefixkey

import "strconv"

// ParseOpenAIChat parses an OpenAI chat completions body (POST /v1/chat/completions).
// It is safe for concurrent use; body is only read, and the returned Request may share its bytes
// (see Parse): do not modify body while the Request is in use.
//
// "model" (a non-empty string) and "messages" (an array) are required. A message's content is a
// string, an array of content parts, or null/absent (assistant messages only, e.g. with
// tool_calls). Text parts ("text", and "refusal") fill Part.Text and, concatenated in order,
// Message.Text; any other part keeps the canonical JSON of its payload (the member named by its
// type, e.g. "image_url", or else the part without "type") in Part.Data. Roles are system,
// developer, user, assistant, tool and the legacy function. System and developer messages (text
// parts only) go to Request.System, joined by "\n" in order, and not to Messages; their other
// fields (e.g. "name") are dropped. A message's fields other than role and content (tool_calls,
// tool_call_id, name, …; nulls dropped) go to Message.Extra as canonical JSON. A non-text part
// with members besides type and its payload (vLLM's "uuid") keeps the whole part without type.
// Parts of type image_url, video_url, audio_url and input_audio are also listed in Request.Media
// with their identities (see Media).
//
// The sampling parameters temperature, top_p, max_tokens, max_completion_tokens, stream, n, seed,
// stop, presence_penalty, frequency_penalty, response_format, logit_bias, tools and tool_choice
// fill Params (JSON-valued ones as canonical JSON: compact, object keys sorted recursively,
// duplicate keys reduced to the last); an explicit null is the same as an absent field. vLLM's
// cache_salt (a non-empty string of at most MaxCacheSaltLength bytes) fills Request.CacheSalt.
// Other top-level fields go to Params.Other. For duplicate top-level keys the last one wins.
//
// It returns a non-nil Request and a nil error, or a nil Request and a *FieldError (wrapping
// ErrMalformed) naming the offending field, e.g. "messages[2].content", when the body is not
// valid JSON, not an object, or not a valid chat request.
func ParseOpenAIChat(body []byte) (*Request, error) {
	var d decoder
	d.init(body)
	r := &Request{Format: FormatOpenAIChat}
	if err := d.begin(); err != nil {
		return nil, err
	}
	haveMessages := false
	first := true
	for {
		k, more, err := d.next(&first)
		if err != nil {
			return nil, err
		}
		if !more {
			break
		}
		key := d.strBytes(k)
		switch string(key) {
		case "model":
			if r.Model, err = d.readModel(); err != nil {
				return nil, err
			}
		case "cache_salt":
			if r.CacheSalt, err = d.readCacheSalt(); err != nil {
				return nil, err
			}
		case "messages":
			d.resetMessages()
			d.sys, d.sysView = d.sys[:0], jstr{}
			r.HasSystem = false
			var null bool
			if null, err = d.readNull(); err == nil && !null {
				haveMessages = true
				err = d.openAIMessages(r)
			} else if null {
				haveMessages = false
			}
			if err != nil {
				return nil, atField(err, "messages")
			}
		default:
			handled, err := d.param(&r.Params, k, FormatOpenAIChat)
			if err == nil && !handled {
				err = d.skipUnknown(k)
			}
			if err != nil {
				return nil, err
			}
		}
	}
	if err := d.end(); err != nil {
		return nil, err
	}
	if r.Model == "" {
		return nil, fieldErr("model", "is required")
	}
	if !haveMessages {
		return nil, fieldErr("messages", "is required")
	}
	if err := checkRanges(&r.Params, r.Format); err != nil {
		return nil, err
	}
	d.finish(r)
	return r, nil
}

// openAIMessages reads the messages array at d.pos.
func (d *decoder) openAIMessages(r *Request) error {
	if d.peek() != '[' {
		return fieldErr("", "must be an array of messages")
	}
	d.pos++
	first := true
	for i := 0; ; i++ {
		more, err := d.nextElem(&first)
		if err != nil {
			return err
		}
		if !more {
			return nil
		}
		if d.peek() != '{' {
			return atIndex(fieldErr("", "must be an object"), i)
		}
		if err := d.openAIMessage(r); err != nil {
			return atIndex(err, i)
		}
	}
}

// openAIRole returns the canonical role string for b.
func openAIRole(b []byte) (string, bool) {
	switch string(b) {
	case "system":
		return "system", true
	case "developer":
		return "developer", true
	case "user":
		return "user", true
	case "assistant":
		return "assistant", true
	case "tool":
		return "tool", true
	case "function":
		return "function", true
	}
	return "", false
}

// readRole reads a role string with lookup and names the field "role" in its errors.
func (d *decoder) readRole(lookup func([]byte) (string, bool), allowed string) (string, error) {
	if d.peek() != '"' {
		return "", fieldErr("role", "must be a string")
	}
	s, err := d.scanString()
	if err != nil {
		return "", atField(err, "role")
	}
	b := d.strBytes(s)
	role, ok := lookup(b)
	if !ok {
		return "", fieldErr("role", "unknown role "+strconv.Quote(string(b))+"; want "+allowed)
	}
	return role, nil
}

// openAIMessage reads the message object at d.pos (messages[i], depth 3).
func (d *decoder) openAIMessage(r *Request) error {
	const depth = 3
	d.pos++
	textLo, dataLo, partLo, memBase := len(d.text), len(d.data), len(d.parts), len(d.members)
	mediaLo := len(d.media)
	defer func() { d.members = d.members[:memBase] }()
	var role string
	haveContent, contentNull := false, false
	first := true
	for {
		k, more, err := d.next(&first)
		if err != nil {
			return err
		}
		if !more {
			break
		}
		key := d.strBytes(k)
		switch string(key) {
		case "role":
			if role, err = d.readRole(openAIRole, "system, developer, user, assistant, tool or function"); err != nil {
				return err
			}
		case "content":
			d.text, d.data, d.parts, d.media = d.text[:textLo], d.data[:dataLo], d.parts[:partLo], d.media[:mediaLo]
			haveContent = true
			if contentNull, err = d.openAIContent(depth + 1); err != nil {
				return atField(err, "content")
			}
		default:
			if d.members == nil {
				d.members = make([]member, 0, 8)
			}
			m := member{key: d.decodedKey(k), val: d.pos}
			if d.pos < len(d.buf) {
				m.kind = d.buf[d.pos]
			}
			if err := d.skipValue(depth); err != nil {
				return atField(err, string(d.keyOf(m.key)))
			}
			d.members = append(d.members, m)
		}
	}
	if role == "" {
		return fieldErr("role", "is required")
	}
	if (!haveContent || contentNull) && role != "assistant" {
		return fieldErr("content", "is required for role "+role)
	}
	if role == "system" || role == "developer" {
		for i, p := range d.parts[partLo:] {
			if p.typ != kindText {
				return fieldErr("content["+strconv.Itoa(i)+"]", "system and developer messages may hold text parts only")
			}
		}
		if lo, hi, ok := d.textView(textLo); ok && !r.HasSystem {
			d.sysView = jstr{lo: lo, hi: hi} // one system message so far: its text stays in the body
		} else {
			if v := d.sysView; v.hi > v.lo { // a second one: the first is copied after all
				d.sys, d.sysView = append(d.sys[:0], d.buf[v.lo:v.hi]...), jstr{}
			}
			if r.HasSystem {
				d.sys = append(d.sys, '\n')
			}
			d.sys = append(d.sys, d.text[textLo:]...)
		}
		r.HasSystem = true
		d.text, d.parts = d.text[:textLo], d.parts[:partLo]
		return nil
	}
	xlo, xhi, err := d.addExtra(memBase, depth)
	if err != nil {
		return err
	}
	d.addMsg(role, textLo, partLo, xlo, xhi)
	return nil
}

// openAIContent reads a message's content at d.pos into d.text and d.parts. null reports an
// explicit null.
func (d *decoder) openAIContent(depth int) (null bool, err error) {
	switch d.peek() {
	case 'n':
		return true, d.scanLiteral()
	case '"':
		s, err := d.scanString()
		if err != nil {
			return false, err
		}
		lo := len(d.text)
		d.text = d.appendStr(d.text, s)
		d.noteText(s, lo)
		d.addPart("text", lo, len(d.text), 0, 0)
		return false, nil
	case '[':
	default:
		return false, fieldErr("", "must be a string, null or an array of content parts")
	}
	d.pos++
	first := true
	for i := 0; ; i++ {
		more, err := d.nextElem(&first)
		if err != nil {
			return false, err
		}
		if !more {
			return false, nil
		}
		if d.peek() != '{' {
			return false, atIndex(fieldErr("", "must be a content part object"), i)
		}
		base := len(d.members)
		err = d.recordMembers(depth + 1)
		if err == nil {
			err = d.openAIPart(d.members[base:], depth+1)
		}
		d.members = d.members[:base]
		if err != nil {
			return false, atIndex(err, i)
		}
	}
}

// openAIPart adds the content part whose members are ms.
func (d *decoder) openAIPart(ms []member, depth int) error {
	typ, err := d.typeOf(ms)
	if err != nil {
		return err
	}
	switch typ {
	case "text", "refusal":
		lo, hi, err := d.textMember(ms, typ)
		if err != nil {
			return err
		}
		d.addPart(typ, lo, hi, 0, 0)
		return nil
	}
	lo := len(d.data)
	if m := d.findMember(ms, typ); m != nil && m.kind != 'n' && typ != "type" && d.onlyMembers(ms, typ) {
		if d.data, err = d.canonicalAt(d.data, m.val, depth+1); err != nil {
			err = atField(err, typ)
		}
	} else {
		d.data, _, err = d.canonicalObject(d.data, ms, dropType, depth)
	}
	if err != nil {
		return err
	}
	if kind := mediaKind(kindOf(typ), typ, false); kind != "" {
		if err := d.openAIMedia(ms, typ, kind, d.data[lo:], depth); err != nil {
			return err
		}
	}
	d.addPart(typ, 0, 0, lo, len(d.data))
	return nil
}

// onlyMembers reports whether every member of ms is named "type" or name.
func (d *decoder) onlyMembers(ms []member, name string) bool {
	for i := range ms {
		if k := string(d.keyOf(ms[i].key)); k != "type" && k != name {
			return false
		}
	}
	return true
}

// ParseOpenAICompletion parses an OpenAI completions body (POST /v1/completions).
// It is safe for concurrent use; body is only read, and the returned Request may share its bytes
// (see Parse): do not modify body while the Request is in use.
//
// "model" (a non-empty string) and "prompt" are required. A prompt is a string (Prompt holds
// it), a non-empty array of strings (Prompt holds them in order), an array of token IDs, or an
// array of arrays of token IDs; token IDs are integers in [0, 2^32) and PromptTokens holds the
// first prompt's (the others are validated, not kept). Parameters and cache_salt are read as by
// ParseOpenAIChat; other top-level fields go to Params.Other.
//
// It returns a non-nil Request and a nil error, or a nil Request and a *FieldError (wrapping
// ErrMalformed) naming the offending field, e.g. "prompt[1][3]".
func ParseOpenAICompletion(body []byte) (*Request, error) {
	var d decoder
	d.init(body)
	r := &Request{Format: FormatOpenAICompletion}
	if err := d.begin(); err != nil {
		return nil, err
	}
	havePrompt := false
	first := true
	for {
		k, more, err := d.next(&first)
		if err != nil {
			return nil, err
		}
		if !more {
			break
		}
		key := d.strBytes(k)
		switch string(key) {
		case "model":
			if r.Model, err = d.readModel(); err != nil {
				return nil, err
			}
		case "cache_salt":
			if r.CacheSalt, err = d.readCacheSalt(); err != nil {
				return nil, err
			}
		case "prompt":
			d.text, d.prompts, r.PromptTokens = d.text[:0], d.prompts[:0], nil
			var null bool
			if null, err = d.readNull(); err == nil && !null {
				havePrompt = true
				r.PromptTokens, err = d.prompt()
			} else if null {
				havePrompt = false
			}
			if err != nil {
				return nil, atField(err, "prompt")
			}
		default:
			handled, err := d.param(&r.Params, k, FormatOpenAICompletion)
			if err == nil && !handled {
				err = d.skipUnknown(k)
			}
			if err != nil {
				return nil, err
			}
		}
	}
	if err := d.end(); err != nil {
		return nil, err
	}
	if r.Model == "" {
		return nil, fieldErr("model", "is required")
	}
	if !havePrompt {
		return nil, fieldErr("prompt", "is required")
	}
	if err := checkRanges(&r.Params, r.Format); err != nil {
		return nil, err
	}
	d.finish(r)
	return r, nil
}

// prompt reads a completions prompt at d.pos: strings go to d.prompts, the first token array is
// returned.
func (d *decoder) prompt() ([]uint32, error) {
	switch d.peek() {
	case '"':
		return nil, d.promptString()
	case '[':
	default:
		return nil, fieldErr("", "must be a string, an array of strings, an array of token IDs or an array of token ID arrays")
	}
	d.pos++
	first := true
	var kind byte
	var tokens []uint32
	for i := 0; ; i++ {
		more, err := d.nextElem(&first)
		if err != nil {
			return nil, err
		}
		if !more {
			break
		}
		c := d.peek()
		if i == 0 {
			kind = c
			if isNumStart(c) {
				kind = '0'
				tokens = []uint32{}
			}
		}
		switch {
		case kind == '"' && c == '"':
			err = d.promptString()
		case kind == '0' && isNumStart(c):
			var t uint32
			t, err = d.readTokenID()
			tokens = append(tokens, t)
		case kind == '[' && c == '[':
			var ts []uint32
			ts, err = d.tokenArray(i == 0)
			if i == 0 {
				tokens = ts
			}
		default:
			switch kind {
			case '"':
				err = fieldErr("", "must be a string like the first prompt")
			case '0':
				err = fieldErr("", "must be a token ID like the first element")
			case '[':
				err = fieldErr("", "must be an array of token IDs like the first prompt")
			default:
				err = fieldErr("", "must be a string, a token ID or an array of token IDs")
			}
		}
		if err != nil {
			return nil, atIndex(err, i)
		}
	}
	if kind == 0 {
		return nil, fieldErr("", "must not be empty")
	}
	return tokens, nil
}

func (d *decoder) promptString() error {
	s, err := d.scanString()
	if err != nil {
		return err
	}
	if s.plain && s.hi-s.lo >= viewMin { // as written in the body: Prompt refers to it
		d.prompts = append(grow(d.prompts), jstr{lo: s.lo, hi: s.hi, plain: true})
		return nil
	}
	lo := len(d.text)
	d.text = d.appendStr(d.text, s)
	d.prompts = append(grow(d.prompts), jstr{lo: lo, hi: len(d.text)})
	return nil
}

// tokenArray reads an array of token IDs at d.pos; keep returns them, otherwise they are only
// validated.
func (d *decoder) tokenArray(keep bool) ([]uint32, error) {
	d.pos++
	var tokens []uint32
	if keep {
		tokens = []uint32{}
	}
	first := true
	for i := 0; ; i++ {
		more, err := d.nextElem(&first)
		if err != nil {
			return nil, err
		}
		if !more {
			return tokens, nil
		}
		t, err := d.readTokenID()
		if err != nil {
			return nil, atIndex(err, i)
		}
		if keep {
			tokens = append(tokens, t)
		}
	}
}
