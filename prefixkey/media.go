package prefixkey

import (
	"strings"

	"github.com/zeebo/xxh3"
)

// Kinds of Media items.
const (
	MediaImage = "image"
	MediaAudio = "audio"
	MediaVideo = "video"
)

// Media is one multimodal item of a request's messages — an image, an audio clip or a video — as
// the parser found it, in order of appearance. Its Hash is the item's identity (see MediaURLHash,
// MediaDataHash and MediaUUIDHash): two items with one Hash are taken to be the same content.
//
// The parsers record:
//
//   - OpenAI chat: content parts of type image_url, video_url and audio_url ({"url": …}, or the
//     URL as a plain string) and input_audio ({"data": base64, "format": …}).
//   - Anthropic messages: content blocks of type image (source {"type": "base64", "media_type",
//     "data"}, {"type": "url", "url"}, or any other source), also inside a tool_result's content.
//
// A Media is a plain value.
type Media struct {
	Kind string // MediaImage, MediaAudio or MediaVideo
	// Message is the item's index in Request.Messages and Part its part's index in that
	// message's Parts (for an image inside an Anthropic tool_result: the tool_result's).
	Message int
	Part    int
	// Offset is the number of bytes of the message's Text before the item: the item sits
	// between Text[:Offset] and Text[Offset:].
	Offset int
	// Hash is the item's identity: MediaUUIDHash of vLLM's "uuid" when the part carries one, else
	// MediaURLHash of its URL or MediaDataHash of its base64 data, else an XXH3-64 of the
	// canonical JSON of its payload (Part.Data) seeded apart from the others.
	Hash uint64
}

// Seeds that keep the identities of the different sources apart (ASCII "kvr-url ", "kvr-data",
// "kvr-part"). MediaUUIDHash is unseeded, as vLLM's extra keys are folded (events.ExtraKeyHash).
const (
	seedMediaURL   = 0x6b76722d75726c20
	seedMediaData  = 0x6b76722d64617461
	seedMediaOther = 0x6b76722d70617274
)

// MediaURLHash returns the identity of a media item given by URL: XXH3-64 of the URL string as
// sent, seeded with "kvr-url " (0x6b76722d75726c20), except for a base64 data: URI
// ("data:[<media type>][;…];base64,<payload>", scheme and ";base64" in any case), whose identity
// is MediaDataHash(payload). kvroute does not fetch URLs: the same image behind two URLs has two
// identities, and an image that changes behind one URL keeps one. It does not allocate and is safe
// for concurrent use.
func MediaURLHash(url string) uint64 {
	if payload, ok := dataURIPayload(url); ok {
		return MediaDataHash(payload)
	}
	return xxh3.HashStringSeed(url, seedMediaURL)
}

// MediaDataHash returns the identity of a media item given inline as base64 text (the payload of
// a data: URI, an Anthropic base64 source's data, an OpenAI input_audio's data): XXH3-64 of the
// base64 text as sent, not decoded, seeded with "kvr-data" (0x6b76722d64617461). The same bytes
// therefore have one identity whether sent as an OpenAI data URI, an Anthropic base64 source or an
// input_audio, whatever media type they are labelled with; encodings that differ in padding or
// line breaks differ. It does not allocate and is safe for concurrent use.
func MediaDataHash(base64 string) uint64 {
	return xxh3.HashStringSeed(base64, seedMediaData)
}

// MediaUUIDHash returns the identity of a media item that carries vLLM's optional "uuid" (a
// user-supplied stable identifier of the item, sent beside image_url, input_audio, …): XXH3-64 of
// the uuid, unseeded — the value package events folds an engine's multimodal identifier into
// (events.ExtraKeyHash), so that block keys built with it match the engine's extra keys when vLLM
// uses the uuid as the item's identifier. It does not allocate and is safe for concurrent use.
func MediaUUIDHash(uuid string) uint64 {
	return xxh3.HashString(uuid)
}

// mediaOtherHash is the identity of an item with neither uuid, URL nor data: its payload's
// canonical JSON.
func mediaOtherHash(canonical []byte) uint64 {
	return xxh3.HashSeed(canonical, seedMediaOther)
}

// dataURIPayload returns the payload of a base64 data: URI, and false for any other string.
func dataURIPayload(s string) (string, bool) {
	if len(s) < 5 || !strings.EqualFold(s[:5], "data:") {
		return "", false
	}
	comma := strings.IndexByte(s, ',')
	if comma < 0 {
		return "", false
	}
	meta := s[5:comma]
	if len(meta) < 7 || !strings.EqualFold(meta[len(meta)-7:], ";base64") {
		return "", false
	}
	return s[comma+1:], true
}

// mediaKind returns the Media kind of a part or block type of format f ("" when it is no media).
func mediaKind(k partKind, typ string, anthropic bool) string {
	if anthropic {
		if k == kindImage {
			return MediaImage
		}
		return ""
	}
	switch k {
	case kindImageURL:
		return MediaImage
	case kindInputAudio:
		return MediaAudio
	case kindOther:
		switch typ {
		case "video_url":
			return MediaVideo
		case "audio_url":
			return MediaAudio
		}
	}
	return ""
}

// MediaPlaced reports whether block keys can tell r's media apart: r has no Media, or the caller
// placed them in the token sequence (MultiModal is set). Block keys of a request with media and no
// spans are those of its text and placeholder tokens alone, which two requests with different
// images share: Request.BlockKeys gives none then, and callers computing block keys themselves
// (AppendBlockKeys) should do the same.
func (r *Request) MediaPlaced() bool {
	return len(r.Media) == 0 || len(r.MultiModal) > 0
}
