package prefixkey

// ParseAnthropicMessages parses an Anthropic messages body (POST /v1/messages).
// It is safe for concurrent use; body is only read, and the returned Request may share its bytes
// (see Parse): do not modify body while the Request is in use.
//
// "model" (a non-empty string) and "messages" (an array) are required. The top-level "system" is
// a string or an array of text blocks; it fills Request.System (block texts joined by "\n") and
// sets HasSystem. Message roles are user and assistant; content is a string or an array of content
// blocks; a block's own cache_control member never changes the result. Block types:
//
//   - text: Part.Text.
//   - thinking: the thinking text in Part.Text (type "thinking").
//   - image: the canonical JSON of its source in Part.Data; the image is listed in Request.Media
//     (as are images inside a tool_result's content).
//   - tool_result: the text of its content (a string, or its text blocks concatenated) in
//     Part.Text; the canonical JSON of the block without type, cache_control and (when it holds
//     text only) content, in Part.Data.
//   - tool_use, redacted_thinking, document and any other type: the canonical JSON of the block
//     without type and cache_control, in Part.Data.
//
// Message.Text concatenates its parts' Text in order. A message's fields other than role and
// content go to Message.Extra as canonical JSON. The parameters max_tokens, temperature, top_p,
// stop_sequences (Params.Stop), stream, tools and tool_choice fill Params; other top-level fields
// (top_k, thinking, cache_salt, …) go to Params.Other, but for output-neutral ones such as
// metadata. An explicit null is the same as an absent field; for duplicate top-level keys the last
// one wins.
//
// It returns a non-nil Request and a nil error, or a nil Request and a *FieldError (wrapping
// ErrMalformed) naming the offending field, e.g. "messages[1].content[0].source".
func ParseAnthropicMessages(body []byte) (*Request, error) {
	var d decoder
	d.init(body)
	r := &Request{Format: FormatAnthropicMessages}
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
		case "system":
			d.sys, d.sysView = d.sys[:0], jstr{}
			if r.HasSystem, err = d.anthropicSystem(); err != nil {
				return nil, atField(err, "system")
			}
		case "messages":
			d.resetMessages()
			var null bool
			if null, err = d.readNull(); err == nil && !null {
				haveMessages = true
				err = d.anthropicMessages()
			} else if null {
				haveMessages = false
			}
			if err != nil {
				return nil, atField(err, "messages")
			}
		default:
			handled, err := d.param(&r.Params, k, FormatAnthropicMessages)
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

// anthropicSystem reads the top-level system value into d.sys and reports whether there is one.
func (d *decoder) anthropicSystem() (bool, error) {
	switch d.peek() {
	case 'n':
		return false, d.scanLiteral()
	case '"':
		s, err := d.scanString()
		if err != nil {
			return false, err
		}
		if s.plain && s.hi-s.lo >= viewMin { // as written in the body: System refers to it
			d.sysView = s
			return true, nil
		}
		d.sys = d.appendStr(d.sys, s)
		return true, nil
	case '[':
	default:
		return false, fieldErr("", "must be a string or an array of text blocks")
	}
	d.pos++
	first := true
	for i := 0; ; i++ {
		more, err := d.nextElem(&first)
		if err != nil {
			return false, err
		}
		if !more {
			return true, nil
		}
		if d.peek() != '{' {
			return false, atIndex(fieldErr("", "must be a text block object"), i)
		}
		base := len(d.members)
		err = d.recordMembers(2)
		if err == nil {
			err = d.systemBlock(d.members[base:], i > 0)
		}
		d.members = d.members[:base]
		if err != nil {
			return false, atIndex(err, i)
		}
	}
}

func (d *decoder) systemBlock(ms []member, sep bool) error {
	typ, err := d.typeOf(ms)
	if err != nil {
		return err
	}
	if typ != "text" {
		return fieldErr("type", "must be \"text\" in system blocks")
	}
	m := d.findMember(ms, "text")
	if m == nil || m.kind == 'n' {
		return fieldErr("text", "is required")
	}
	if m.kind != '"' {
		return fieldErr("text", "must be a string")
	}
	if sep {
		d.sys = append(d.sys, '\n')
	}
	d.sys = d.appendStr(d.sys, m.s)
	return nil
}

// anthropicMessages reads the messages array at d.pos.
func (d *decoder) anthropicMessages() error {
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
		if err := d.anthropicMessage(); err != nil {
			return atIndex(err, i)
		}
	}
}

func anthropicRole(b []byte) (string, bool) {
	switch string(b) {
	case "user":
		return "user", true
	case "assistant":
		return "assistant", true
	}
	return "", false
}

// anthropicMessage reads the message object at d.pos (messages[i], depth 3).
func (d *decoder) anthropicMessage() error {
	const depth = 3
	d.pos++
	textLo, dataLo, partLo, memBase := len(d.text), len(d.data), len(d.parts), len(d.members)
	mediaLo := len(d.media)
	defer func() { d.members = d.members[:memBase] }()
	var role string
	haveContent := false
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
			if role, err = d.readRole(anthropicRole, "user or assistant"); err != nil {
				return err
			}
		case "content":
			d.text, d.data, d.parts, d.media = d.text[:textLo], d.data[:dataLo], d.parts[:partLo], d.media[:mediaLo]
			var null bool
			if null, err = d.anthropicContent(depth + 1); err != nil {
				return atField(err, "content")
			}
			haveContent = !null
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
	if !haveContent {
		return fieldErr("content", "is required")
	}
	xlo, xhi, err := d.addExtra(memBase, depth)
	if err != nil {
		return err
	}
	d.addMsg(role, textLo, partLo, xlo, xhi)
	return nil
}

// anthropicContent reads a message's content at d.pos. null reports an explicit null.
func (d *decoder) anthropicContent(depth int) (null bool, err error) {
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
		return false, fieldErr("", "must be a string or an array of content blocks")
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
			return false, atIndex(fieldErr("", "must be a content block object"), i)
		}
		base := len(d.members)
		err = d.recordMembers(depth + 1)
		if err == nil {
			err = d.anthropicBlock(base, depth+1)
		}
		d.members = d.members[:base]
		if err != nil {
			return false, atIndex(err, i)
		}
	}
}

// anthropicBlock adds the content block whose members are d.members[base:].
func (d *decoder) anthropicBlock(base, depth int) error {
	ms := d.members[base:]
	typ, err := d.typeOf(ms)
	if err != nil {
		return err
	}
	switch typ {
	case "text", "thinking":
		lo, hi, err := d.textMember(ms, typ)
		if err != nil {
			return err
		}
		d.addPart(typ, lo, hi, 0, 0)
		return nil
	case "image":
		src := d.findMember(ms, "source")
		if src == nil || src.kind == 'n' {
			return fieldErr("source", "is required")
		}
		if src.kind != '{' {
			return fieldErr("source", "must be an object")
		}
		lo := len(d.data)
		if d.data, err = d.canonicalAt(d.data, src.val, depth+1); err != nil {
			return atField(err, "source")
		}
		if err := d.anthropicImage(src, d.data[lo:], depth+1); err != nil {
			return err
		}
		d.addPart(typ, 0, 0, lo, len(d.data))
		return nil
	case "tool_result":
		tlo := len(d.text)
		flags := dropType | dropCacheControl
		if c := d.findMember(ms, "content"); c != nil {
			textOnly, err := d.toolResultContent(c, depth+1)
			if err != nil {
				return atField(err, "content")
			}
			if textOnly {
				flags |= dropContent
			}
		}
		// d.members may have grown (and moved) while reading the content: take ms again.
		ms = d.members[base:]
		lo := len(d.data)
		if d.data, _, err = d.canonicalObject(d.data, ms, flags, depth); err != nil {
			return err
		}
		d.addPart(typ, tlo, len(d.text), lo, len(d.data))
		return nil
	default:
		lo := len(d.data)
		if d.data, _, err = d.canonicalObject(d.data, ms, dropType|dropCacheControl, depth); err != nil {
			return err
		}
		d.addPart(typ, 0, 0, lo, len(d.data))
		return nil
	}
}

// toolResultContent appends the text of a tool_result's content member c to d.text and reports
// whether the content is text only (a string, null, or text blocks only).
func (d *decoder) toolResultContent(c *member, depth int) (textOnly bool, err error) {
	switch c.kind {
	case 'n':
		return true, nil
	case '"':
		d.text = d.appendStr(d.text, c.s)
		return true, nil
	case '[':
	default:
		return false, fieldErr("", "must be a string or an array of content blocks")
	}
	saved := d.pos
	defer func() { d.pos = saved }()
	d.pos = c.val + 1
	textOnly = true
	first := true
	for i := 0; ; i++ {
		more, err := d.nextElem(&first)
		if err != nil {
			return false, err
		}
		if !more {
			return textOnly, nil
		}
		if d.peek() != '{' {
			return false, atIndex(fieldErr("", "must be a content block object"), i)
		}
		base := len(d.members)
		err = d.recordMembers(depth + 1)
		var typ string
		if err == nil {
			typ, err = d.typeOf(d.members[base:])
		}
		if err == nil && typ == "text" {
			_, _, err = d.textMember(d.members[base:], "text")
		} else if err == nil {
			textOnly = false
			if typ == "image" {
				// An image in a tool result is in the prompt as much as one in the message.
				err = d.anthropicImage(d.findMember(d.members[base:], "source"), nil, depth+2)
			}
		}
		d.members = d.members[:base]
		if err != nil {
			return false, atIndex(err, i)
		}
	}
}
