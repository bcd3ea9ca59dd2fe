package prefixkey

import "strconv"

// This file holds what the parsers do for multimodal items (Request.Media) and for vLLM's
// cache_salt.

// MaxCacheSaltLength is the longest cache_salt, in bytes, the parsers accept.
const MaxCacheSaltLength = 1024

// MaxMediaItems is the most image, audio and video parts a request may carry: a request with more
// is refused (vLLM's own per-prompt limits, limit_mm_per_prompt, are far lower), so that a body
// of tiny parts cannot make the parser hash and record hundreds of thousands of them.
const MaxMediaItems = 256

// mediaRoom returns the error for a request that already holds MaxMediaItems media items.
func (d *decoder) mediaRoom() error {
	if len(d.media) >= MaxMediaItems {
		return fieldErr("", "the request has more than "+strconv.Itoa(MaxMediaItems)+" image, audio or video parts")
	}
	return nil
}

// readCacheSalt reads vLLM's top-level cache_salt: a non-empty string of at most
// MaxCacheSaltLength bytes (vLLM, too, refuses an empty one); null reads as "" (absent).
func (d *decoder) readCacheSalt() (string, error) {
	switch d.peek() {
	case 'n':
		return "", d.scanLiteral()
	case '"':
	default:
		return "", fieldErr("cache_salt", "must be a string")
	}
	s, err := d.scanString()
	if err != nil {
		return "", atField(err, "cache_salt")
	}
	b := d.strBytes(s)
	switch {
	case len(b) == 0:
		return "", fieldErr("cache_salt", "must be a non-empty string")
	case len(b) > MaxCacheSaltLength:
		return "", fieldErr("cache_salt", "must be at most "+strconv.Itoa(MaxCacheSaltLength)+" bytes")
	}
	return string(b), nil
}

// mediaRef is a Media whose kind is a small code, so that it holds no pointer.
type mediaRef struct {
	kind           uint8 // mediaCode
	msg, part, off int32
	hash           uint64
}

func mediaCode(kind string) uint8 {
	switch kind {
	case MediaImage:
		return 1
	case MediaAudio:
		return 2
	default:
		return 3
	}
}

func mediaKindOfCode(c uint8) string {
	switch c {
	case 1:
		return MediaImage
	case 2:
		return MediaAudio
	default:
		return MediaVideo
	}
}

// addMedia records a media item at the current position: in the message being read (the next in
// d.msgs), in the part about to be added, after the text read so far. The message being read
// starts in d.text and d.parts where the last one added ends (a system message, which is not
// added, leaves the arenas as it found them).
func (d *decoder) addMedia(kind string, h uint64) {
	textLo, partLo := 0, 0
	if n := len(d.msgs); n > 0 {
		textLo, partLo = d.textEnd, int(d.msgs[n-1].phi)
	}
	d.media = append(grow(d.media), mediaRef{kind: mediaCode(kind), msg: int32(len(d.msgs)),
		part: int32(len(d.parts) - partLo), off: int32(len(d.text) - textLo), hash: h})
}

// nestedString returns the string member key of the object at body offset pos (already
// validated), leaving d.pos and d.members as they were; ok is false when the value is not an
// object or has no such string member.
func (d *decoder) nestedString(pos, depth int, key string) (s jstr, ok bool, err error) {
	if pos >= len(d.buf) || d.buf[pos] != '{' {
		return jstr{}, false, nil
	}
	saved, base := d.pos, len(d.members)
	d.pos = pos
	err = d.recordMembers(depth)
	if err == nil {
		if m := d.findMember(d.members[base:], key); m != nil && m.kind == '"' {
			s, ok = m.s, true
		}
	}
	d.pos, d.members = saved, d.members[:base]
	return s, ok, err
}

// strView returns the decoded value of s as a string that is valid until the next strBytes: for
// hashing it at once, without a copy.
func (d *decoder) strView(s jstr) string { return arenaString(d.strBytes(s)) }

// openAIMedia records the media item of the OpenAI content part whose members are ms, of type typ
// and media kind kind; data is the part's Data (canonical JSON). The identity is, in order of
// preference: the part's "uuid" (vLLM), the payload's url (image_url, video_url, audio_url: an
// object's "url", or a plain string) or data (input_audio), the canonical payload.
func (d *decoder) openAIMedia(ms []member, typ, kind string, data []byte, depth int) error {
	if err := d.mediaRoom(); err != nil {
		return err
	}
	if u := d.findMember(ms, "uuid"); u != nil && u.kind == '"' && u.s.hi > u.s.lo {
		d.addMedia(kind, MediaUUIDHash(d.strView(u.s)))
		return nil
	}
	if m := d.findMember(ms, typ); m != nil {
		if typ == "input_audio" {
			s, ok, err := d.nestedString(m.val, depth+1, "data")
			if err != nil {
				return atField(err, typ)
			}
			if ok {
				d.addMedia(kind, MediaDataHash(d.strView(s)))
				return nil
			}
		} else {
			s, ok := m.s, m.kind == '"'
			if !ok {
				var err error
				if s, ok, err = d.nestedString(m.val, depth+1, "url"); err != nil {
					return atField(err, typ)
				}
			}
			if ok {
				d.addMedia(kind, MediaURLHash(d.strView(s)))
				return nil
			}
		}
	}
	d.addMedia(kind, mediaOtherHash(data))
	return nil
}

// anthropicImage records the image block whose source member is src (validated JSON): a base64
// source by its data, a url source by its URL, any other by its canonical JSON — canon, or, when
// nil, computed here (a missing source by the empty string's).
func (d *decoder) anthropicImage(src *member, canon []byte, depth int) error {
	if err := d.mediaRoom(); err != nil {
		return err
	}
	if src != nil && src.kind == '{' {
		saved, base := d.pos, len(d.members)
		d.pos = src.val
		err := d.recordMembers(depth)
		var h uint64
		ok := false
		if err == nil {
			ms := d.members[base:]
			t := d.findMember(ms, "type")
			if t != nil && t.kind == '"' {
				switch d.strView(t.s) {
				case "base64":
					if v := d.findMember(ms, "data"); v != nil && v.kind == '"' {
						h, ok = MediaDataHash(d.strView(v.s)), true
					}
				case "url":
					if v := d.findMember(ms, "url"); v != nil && v.kind == '"' {
						h, ok = MediaURLHash(d.strView(v.s)), true
					}
				}
			}
		}
		d.pos, d.members = saved, d.members[:base]
		if err != nil {
			return atField(err, "source")
		}
		if ok {
			d.addMedia(MediaImage, h)
			return nil
		}
	}
	if canon != nil || src == nil {
		d.addMedia(MediaImage, mediaOtherHash(canon))
		return nil
	}
	// Hash the canonical source at the end of the Part.Data arena, then drop it: nothing is
	// being built there while a tool_result's content is read.
	lo := len(d.data)
	var err error
	if d.data, err = d.canonicalAt(d.data, src.val, depth); err != nil {
		d.data = d.data[:lo]
		return atField(err, "source")
	}
	h := mediaOtherHash(d.data[lo:])
	d.data = d.data[:lo]
	d.addMedia(MediaImage, h)
	return nil
}

// mediaOf converts the decoder's media records for r.
func (d *decoder) mediaOf() []Media {
	if len(d.media) == 0 {
		return nil
	}
	out := make([]Media, len(d.media))
	for i, m := range d.media {
		out[i] = Media{Kind: mediaKindOfCode(m.kind), Message: int(m.msg), Part: int(m.part), Offset: int(m.off), Hash: m.hash}
	}
	return out
}
