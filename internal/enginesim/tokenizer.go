package enginesim

import (
	"github.com/zeebo/xxh3"
	"strings"

	"github.com/kvroute/kvroute/prefixkey"
)

// Vocabulary of the deterministic tokenizer (Llama 3's size and special-token range).
const (
	VocabSize     = 128256
	SpecialBase   = 128000 // first special token ID; ordinary tokens are below it
	BOS           = 128000 // <|begin_of_text|>
	EOS           = 128001 // <|end_of_text|>
	maxPieceBytes = 8      // a word piece longer than this is cut into 8-byte chunks
)

// Fixed IDs of the chat template's role markers.
const (
	tokSystem    = SpecialBase + 2 // <|system|>
	tokUser      = SpecialBase + 3 // <|user|>
	tokAssistant = SpecialBase + 4 // <|assistant|>
	tokTool      = SpecialBase + 5 // <|tool|>
	tokFunction  = SpecialBase + 6 // <|function|>
	tokDeveloper = SpecialBase + 7 // <|developer|>
)

// AppendTokens appends the token IDs of text to dst and returns the extended slice. The tokenizer
// is deterministic and stateless:
//
//   - A special token <|name|> (name of ASCII letters, digits and '_') is one token: the chat
//     template's markers have fixed IDs (<|begin_of_text|> 128000, <|end_of_text|> 128001,
//     <|system|> 128002, <|user|> 128003, <|assistant|> 128004, <|tool|> 128005), any other name
//     128016 + xxh3-64(marker) mod 240.
//   - A word is a maximal run of ASCII letters and digits and bytes ≥ 0x80 (so UTF-8 characters
//     stay whole); a single space directly before a word belongs to it (" word", as in BPE
//     vocabularies). A piece longer than 8 bytes is cut into 8-byte chunks from its start.
//   - Every other byte (punctuation, newline, tab, a space not followed by a word) is one token.
//   - An ordinary piece's ID is xxh3-64(piece bytes) mod 128000.
//
// It is prefix-stable at word boundaries: when a is empty or ends with a word byte or a newline,
// and b starts with a space, a newline or a special token, AppendTokens(nil, a+b) =
// AppendTokens(nil, a) ‖ AppendTokens(nil, b).
// English text gives about one token per 5 bytes. It allocates only to grow dst.
func AppendTokens(dst []uint32, text string) []uint32 {
	for i := 0; i < len(text); {
		c := text[i]
		switch {
		case c == '<' && i+1 < len(text) && text[i+1] == '|':
			if n := specialLen(text[i:]); n > 0 {
				dst = append(dst, specialID(text[i:i+n]))
				i += n
				continue
			}
			dst = append(dst, pieceID(text[i:i+1]))
			i++
		case isWordByte(c) || (c == ' ' && i+1 < len(text) && isWordByte(text[i+1])):
			j := i + 1
			for j < len(text) && isWordByte(text[j]) {
				j++
			}
			for k := i; k < j; k += maxPieceBytes {
				dst = append(dst, pieceID(text[k:min(k+maxPieceBytes, j)]))
			}
			i = j
		default:
			dst = append(dst, pieceID(text[i:i+1]))
			i++
		}
	}
	return dst
}

// Tokenize returns the token IDs of text (AppendTokens(nil, text)): no BOS, no template.
func Tokenize(text string) []uint32 { return AppendTokens(nil, text) }

func isWordByte(c byte) bool {
	return c >= 0x80 || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')
}

// specialLen returns the length of the special token s starts with, 0 when none.
func specialLen(s string) int {
	const maxName = 64
	if !strings.HasPrefix(s, "<|") {
		return 0
	}
	for j := 2; j < len(s) && j < 2+maxName+2; j++ {
		c := s[j]
		switch {
		case c == '|':
			if j > 2 && j+1 < len(s) && s[j+1] == '>' {
				return j + 2
			}
			return 0
		case c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'):
		default:
			return 0
		}
	}
	return 0
}

// specialID returns the ID of a special token: the fixed ones first, others hashed into
// [SpecialBase+16, VocabSize).
func specialID(marker string) uint32 {
	switch marker {
	case "<|begin_of_text|>":
		return BOS
	case "<|end_of_text|>":
		return EOS
	case "<|system|>":
		return tokSystem
	case "<|user|>":
		return tokUser
	case "<|assistant|>":
		return tokAssistant
	case "<|tool|>":
		return tokTool
	case "<|function|>":
		return tokFunction
	case "<|developer|>":
		return tokDeveloper
	}
	return SpecialBase + 16 + uint32(xxh3.HashString(marker)%uint64(VocabSize-SpecialBase-16))
}

func pieceID(p string) uint32 { return uint32(xxh3.HashString(p) % SpecialBase) }

// ChatTokens returns the prompt tokens of a chat request (OpenAI chat or Anthropic messages)
// under the engine's chat template:
//
//	<|begin_of_text|>
//	<|system|>\n{System}\n                   (when HasSystem)
//	<|{role}|>\n{Text}\n                     (each message, in order)
//	<|assistant|>\n                          (when addGenerationPrompt)
//
// tokenized with AppendTokens. Only a message's Text counts (non-text parts are not tokenized).
// Because the generation prompt is the start of the next assistant message, a conversation's next
// turn extends the previous turn's prompt tokens: multi-turn chats hit the prefix cache.
// /tokenize with "messages" (add_generation_prompt defaulting to true) returns the same tokens.
func ChatTokens(r *prefixkey.Request, addGenerationPrompt bool) []uint32 {
	n := 2 + len(r.System)/4
	for i := range r.Messages {
		n += 3 + len(r.Messages[i].Text)/4
	}
	dst := make([]uint32, 0, n)
	dst = append(dst, BOS)
	nl := pieceID("\n")
	if r.HasSystem {
		dst = append(dst, tokSystem, nl)
		dst = AppendTokens(dst, r.System)
		dst = append(dst, nl)
	}
	for i := range r.Messages {
		m := &r.Messages[i]
		dst = append(dst, roleToken(m.Role), nl)
		dst = AppendTokens(dst, m.Text)
		dst = append(dst, nl)
	}
	if addGenerationPrompt {
		dst = append(dst, tokAssistant, nl)
	}
	return dst
}

// roleToken returns the special token of a role's marker <|role|>.
func roleToken(role string) uint32 {
	switch role {
	case "system":
		return tokSystem
	case "user":
		return tokUser
	case "assistant":
		return tokAssistant
	case "tool":
		return tokTool
	}
	return specialID("<|" + role + "|>")
}

// PromptTokens returns the prompt tokens of a request as the engine processes it: ChatTokens with
// the generation prompt for chat and Anthropic requests; for completions, the prompt's token IDs
// when it was given as tokens, else <|begin_of_text|> followed by AppendTokens of the first prompt
// (what /tokenize returns for {"prompt": …}). Only the first prompt of a completions request is
// processed.
func PromptTokens(r *prefixkey.Request) []uint32 {
	if r.TokenIDs != nil {
		return r.TokenIDs
	}
	if r.Format == prefixkey.FormatOpenAICompletion || (!r.HasSystem && len(r.Messages) == 0) {
		if r.PromptTokens != nil {
			return r.PromptTokens
		}
		text := ""
		if len(r.Prompt) > 0 {
			text = r.Prompt[0]
		}
		return AppendTokens([]uint32{BOS}, text)
	}
	return ChatTokens(r, true)
}
