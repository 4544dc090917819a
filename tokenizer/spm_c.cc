// spm_c.cc: the C API of spm_c.h over SentencePiece's C++ SentencePieceProcessor.
//
// Every extern "C" function body is wrapped in try/catch(...): no C++ exception may cross
// into C. Encoding is SentencePiece's own; decoding is done here, piece by piece, so that
// text can be printed while tokens are generated. It follows SentencePiece's Decode (0.1.97
// and later) rule for rule; the model-dependent parts (the unknown surface, how the dummy
// prefix space is removed) are read off the library's own DecodeIds at load time.
#include "tokenizer/spm_c.h"
#include "kernels/utf8.h"

#include <sentencepiece_processor.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";       // U+2581 LOWER ONE EIGHTH BLOCK
constexpr std::string_view kReplacement = "\xEF\xBF\xBD";       // U+FFFD REPLACEMENT CHARACTER
constexpr std::string_view kDefaultUnknown = " \xE2\x81\x87 ";  // " U+2047 "

// How DecodeIds removes the space SentencePiece's normalizer put before the text.
enum class PrefixRule {
    kNone,        // the model adds no dummy prefix: spaces are kept
    kOnce,        // one leading space of the first piece that starts with one
    kWhileEmpty,  // one leading space of every piece while the text so far is empty
};

enum class PieceKind : unsigned char { kNormal, kControl, kUnknown, kByte };

struct PieceInfo {
    PieceKind kind = PieceKind::kNormal;
    unsigned char byte = 0;      // for kByte
    bool leading_space = false;  // normal piece whose text starts with U+2581
    std::string text;            // normal piece with U+2581 replaced by ' '
};

// Copies text into dst (dstlen > 0), NUL-terminated, cut at a UTF-8 character boundary when
// it does not fit, so that dst stays valid UTF-8.
void copy_cut(char *dst, size_t dstlen, std::string_view text) {
    size_t k = text.size() < dstlen - 1 ? text.size() : dstlen - 1;
    if (k < text.size())
        while (k > 0 && utf8_is_trail(static_cast<unsigned char>(text[k]))) k--;
    std::memcpy(dst, text.data(), k);
    dst[k] = '\0';
}

void set_err(char *err, size_t errlen, const std::string &msg) {
    if (err && errlen > 0) copy_cut(err, errlen, msg);
}

// The library's messages may hold newlines, and text from the model (a piece), which could
// hold terminal escape sequences or invalid UTF-8; the caller wants one printable sentence.
std::string one_line(const char *s) {
    std::string flat = s ? s : "";
    for (char &c : flat)
        if (c == '\n' || c == '\r' || c == '\t') c = ' ';
    std::string out(utf8_sanitize(nullptr, 0, flat.data(), flat.size()), '\0');
    utf8_sanitize(&out[0], out.size() + 1, flat.data(), flat.size());
    while (!out.empty() && (out.back() == ' ' || out.back() == '.')) out.pop_back();
    if (out.empty()) out = "unknown error";
    return out;
}

int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

// Length of the valid UTF-8 character at s[0 .. n), 0 when none starts there: utf8.c's
// rules, which are SentencePiece's own (string_util::IsValidDecodeUTF8).
size_t valid_char_len(const unsigned char *s, size_t n) { return utf8_char_len(reinterpret_cast<const char *>(s), n); }

// Bytes a character starting with c0 needs (1..4), or 0 when c0 can start no valid one.
size_t needed_len(unsigned char c0) {
    if (c0 < 0x80) return 1;
    if (c0 >= 0xC2 && c0 <= 0xDF) return 2;
    if (c0 >= 0xE0 && c0 <= 0xEF) return 3;
    if (c0 >= 0xF0 && c0 <= 0xF4) return 4;
    return 0;
}

// Whether the bytes s[0 .. n), fewer than a whole character, can still become a valid
// character when more bytes come. The validity of a character depends only on its first
// two bytes and on the rest being trail bytes, so padding with 0x80 answers for n >= 2.
bool could_complete(const unsigned char *s, size_t n) {
    const size_t need = needed_len(s[0]);
    if (need <= n) return false;  // 0 (bad lead), or long enough and already judged
    if (n == 1) return true;
    unsigned char pad[4];
    std::memcpy(pad, s, n);
    for (size_t i = n; i < need; i++) pad[i] = 0x80;
    return valid_char_len(pad, need) == need;
}

}  // namespace

struct SpmTokenizer {
    sentencepiece::SentencePieceProcessor sp;
    std::vector<PieceInfo> pieces;
    std::string unk_surface{kDefaultUnknown};
    PrefixRule prefix_rule = PrefixRule::kWhileEmpty;
    int vocab = 0, bos = -1, eos = -1;
};

struct SpmStream {
    const SpmTokenizer *t = nullptr;
    unsigned char pending[4] = {0, 0, 0, 0};  // a valid but incomplete UTF-8 prefix
    size_t npending = 0;
    bool emitted = false;          // the decoded text so far is not empty
    bool prefix_consumed = false;  // a leading space was already removed (PrefixRule::kOnce)
    std::string out;               // what the last put/flush returns
};

namespace {

// Emits the pending bytes' characters; at the end of a byte run (`end`), the incomplete
// rest becomes one U+FFFD per byte, as SentencePiece's ProcessBytePieces does.
void drain_bytes(SpmStream *s, bool end) {
    size_t start = 0;
    while (start < s->npending) {
        const unsigned char *p = s->pending + start;
        const size_t n = s->npending - start;
        const size_t len = valid_char_len(p, n);
        if (len > 0) {
            if (!(len == 1 && p[0] == 0))
                s->out.append(reinterpret_cast<const char *>(p), len);  // no NUL in a C string
            s->emitted = true;
            start += len;
        } else if (!end && could_complete(p, n)) {
            break;
        } else {
            s->out.append(kReplacement);
            s->emitted = true;
            start += 1;
        }
    }
    std::memmove(s->pending, s->pending + start, s->npending - start);
    s->npending -= start;
}

void stream_put(SpmStream *s, int id) {
    const SpmTokenizer *t = s->t;
    if (id < 0 || id >= t->vocab) return;  // ignored: emits nothing, changes nothing
    const PieceInfo &pi = t->pieces[static_cast<size_t>(id)];
    if (pi.kind == PieceKind::kByte) {
        if (s->npending >= sizeof s->pending) drain_bytes(s, true);  // only after an out-of-memory throw
        s->pending[s->npending++] = pi.byte;                         // room: a drain never keeps 4 bytes
        drain_bytes(s, false);
        return;
    }
    drain_bytes(s, true);  // any other piece ends a byte run
    switch (pi.kind) {
    case PieceKind::kControl: return;
    case PieceKind::kUnknown:
        s->out += t->unk_surface;
        if (!t->unk_surface.empty()) s->emitted = true;
        return;
    default: break;
    }
    bool strip = false;
    if (pi.leading_space && !s->emitted) {
        if (t->prefix_rule == PrefixRule::kWhileEmpty)
            strip = true;
        else if (t->prefix_rule == PrefixRule::kOnce && !s->prefix_consumed)
            strip = true;
    }
    if (strip) {
        s->prefix_consumed = true;
        s->out.append(pi.text, 1, std::string::npos);
        if (pi.text.size() > 1) s->emitted = true;
    } else {
        s->out += pi.text;
        if (!pi.text.empty()) s->emitted = true;
    }
}

// Reads the pieces' kinds, and what the library's DecodeIds does with the model's unknown
// piece and with leading spaces. Throws on failure.
void analyze(SpmTokenizer *t) {
    auto &sp = t->sp;
    t->vocab = sp.GetPieceSize();
    if (t->vocab <= 0) throw std::runtime_error("the model has no pieces");
    t->bos = sp.bos_id();
    t->eos = sp.eos_id();
    t->pieces.resize(static_cast<size_t>(t->vocab));
    int space_piece = -1, spaced_piece = -1;
    for (int id = 0; id < t->vocab; id++) {
        PieceInfo &pi = t->pieces[static_cast<size_t>(id)];
        const std::string &piece = sp.IdToPiece(id);
        // the decoder prints pieces as they are, as C strings
        if (!utf8_valid(piece.data(), piece.size()))
            throw std::runtime_error("piece " + std::to_string(id) + " is not valid UTF-8 text without NUL bytes");
        if (!std::isfinite(sp.GetScore(id)))
            throw std::runtime_error("piece " + std::to_string(id) + " has a score that is not a finite number");
        // DecodeIds maps ids to text and back, so for a shared text it decodes another id's piece
        if (const int same = sp.PieceToId(piece); same != id)
            throw std::runtime_error("pieces " + std::to_string(std::min(id, same)) + " and " +
                                     std::to_string(std::max(id, same)) + " have the same text");
        if (sp.IsControl(id)) {
            pi.kind = PieceKind::kControl;
        } else if (sp.IsUnknown(id)) {
            pi.kind = PieceKind::kUnknown;
        } else if (sp.IsByte(id)) {
            const int hi = piece.size() == 6 ? hex_digit(piece[3]) : -1,
                      lo = piece.size() == 6 ? hex_digit(piece[4]) : -1;
            if (hi < 0 || lo < 0 || piece.compare(0, 3, "<0x") != 0 || piece[5] != '>')
                throw std::runtime_error("byte piece " + std::to_string(id) + " is not of the form <0xNN>");
            pi.kind = PieceKind::kByte;
            pi.byte = static_cast<unsigned char>(hi * 16 + lo);
        } else {
            std::string_view rest = piece;
            pi.leading_space = rest.substr(0, kSpaceSymbol.size()) == kSpaceSymbol;
            for (size_t pos; (pos = rest.find(kSpaceSymbol)) != std::string_view::npos;) {
                pi.text.append(rest.substr(0, pos));
                pi.text += ' ';
                rest.remove_prefix(pos + kSpaceSymbol.size());
            }
            pi.text.append(rest);
            if (pi.leading_space) {
                if (spaced_piece < 0) spaced_piece = id;
                if (piece == kSpaceSymbol) space_piece = id;
            }
        }
    }
    const int unk = sp.unk_id();
    if (unk >= 0) {
        std::string surface;
        if (sp.Decode(std::vector<int>{unk}, &surface).ok()) t->unk_surface = surface;
        if (!utf8_valid(t->unk_surface.data(), t->unk_surface.size()))
            throw std::runtime_error("the unknown piece's surface (unk_surface) is not valid UTF-8 text");
    }
    // A piece that is exactly U+2581 tells the three rules apart: decoding it twice gives
    // "" (while empty), " " (once) or "  " (none). Without one, "once" and "while empty"
    // give the same text (a stripped piece is never empty), so one spaced piece is enough.
    if (space_piece >= 0) {
        std::string two;
        if (!sp.Decode(std::vector<int>{space_piece, space_piece}, &two).ok())
            throw std::runtime_error("the library cannot decode the model's pieces");
        t->prefix_rule = two.empty() ? PrefixRule::kWhileEmpty : two == " " ? PrefixRule::kOnce : PrefixRule::kNone;
    } else if (spaced_piece >= 0) {
        std::string one;
        if (!sp.Decode(std::vector<int>{spaced_piece}, &one).ok())
            throw std::runtime_error("the library cannot decode the model's pieces");
        t->prefix_rule = !one.empty() && one[0] == ' ' ? PrefixRule::kNone : PrefixRule::kWhileEmpty;
    }
}

// ---- Checks of the serialized model before the library sees it ----
// libsentencepiece trusts a model's precompiled charsmaps: it walks their double-array trie
// without bounds checks and reads the strings the trie indexes with strlen, while loading
// (self-test samples, DecodeIds) and while encoding. So the wrapper reads the protobuf wire
// format itself, only as far as the charsmaps, and refuses what the library cannot use safely.

// Reads a varint of at most max_bytes bytes; false when it is cut short or longer.
bool read_varint(std::string_view *in, uint64_t *v, int max_bytes) {
    uint64_t x = 0;
    for (int i = 0; i < max_bytes && !in->empty(); i++) {
        const auto b = static_cast<unsigned char>(in->front());
        in->remove_prefix(1);
        x |= uint64_t(b & 0x7F) << (7 * i);
        if (!(b & 0x80)) {
            *v = x;
            return true;
        }
    }
    return false;
}

using LengthFieldFn = std::function<void(uint32_t number, std::string_view payload)>;

// Walks the fields of one message in *in, or of a group up to its end tag (end_group > 0),
// calling on_length for every length-delimited field (groups' contents are skipped, as
// protobuf keeps them as unknown fields). False when the bytes are not well-formed protobuf,
// which the library's parser refuses too.
bool walk_fields(std::string_view *in, uint32_t end_group, int depth, const LengthFieldFn &on_length) {
    if (depth > 100) return false;  // protobuf's own nesting limit
    while (!in->empty()) {
        uint64_t tag, v;
        if (!read_varint(in, &tag, 5) || tag > UINT32_MAX || (tag >> 3) == 0) return false;
        const auto number = static_cast<uint32_t>(tag >> 3);
        switch (tag & 7) {
        case 0:
            if (!read_varint(in, &v, 10)) return false;
            break;
        case 1:
        case 5: {
            const size_t n = (tag & 7) == 1 ? 8 : 4;
            if (in->size() < n) return false;
            in->remove_prefix(n);
            break;
        }
        case 2:
            if (!read_varint(in, &v, 5) || v > in->size()) return false;
            if (on_length) on_length(number, in->substr(0, v));
            in->remove_prefix(v);
            break;
        case 3:
            if (!walk_fields(in, number, depth + 1, nullptr)) return false;
            break;
        case 4: return end_group != 0 && number == end_group;
        default: return false;
        }
    }
    return end_group == 0;
}

uint32_t load_u32le(const char *p) {
    const auto *b = reinterpret_cast<const unsigned char *>(p);
    return uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
}

// What is wrong with a precompiled charsmap (normalizer.cc: a little-endian uint32 trie size
// in bytes, the darts-clone double array, then the NUL-terminated replacement strings), or ""
// when the library can use it safely: every unit a search can reach leads inside the array,
// and every value is the start of a NUL-terminated, valid UTF-8 string. The rules hold for
// the charsmaps spm_train compiles (whole 256-unit blocks, strings stored one after another).
std::string charsmap_problem(std::string_view blob) {
    if (blob.empty()) return "";  // no normalization rules
    if (blob.size() < 4)
        return "it is " + std::to_string(blob.size()) + " bytes long, too short for its 4-byte trie size";
    const uint32_t trie_bytes = load_u32le(blob.data());
    if (trie_bytes == 0 || trie_bytes % 1024 != 0)
        return "its trie size " + std::to_string(trie_bytes) + " is not a whole number of 256-unit blocks";
    if (trie_bytes >= blob.size() - 4)
        return "its trie of " + std::to_string(trie_bytes) + " bytes leaves no room for strings in its " +
               std::to_string(blob.size()) + " bytes";
    const std::string_view strings = blob.substr(4 + size_t(trie_bytes));
    if (strings.back() != '\0') return "its last string is not NUL-terminated";
    for (size_t at = 0; at < strings.size();) {
        const size_t end = strings.find('\0', at);
        if (!utf8_valid(strings.data() + at, end - at))
            return "its string at offset " + std::to_string(at) + " is not valid UTF-8";
        at = end + 1;
    }
    // darts-clone units: bits 0-7 the label, bit 8 "has a leaf", bits 10-31 the offset to the
    // children (shifted 8 more with bit 9); bit 31 marks a value unit, which no search enters.
    const size_t n_units = trie_bytes / 4;
    const char *units = blob.data() + 4;
    if (load_u32le(units) >> 31) return "its root unit is a value unit";
    for (size_t i = 0; i < n_units; i++) {
        const uint32_t u = load_u32le(units + 4 * i);
        if (u >> 31) continue;
        const size_t base = i ^ size_t((u >> 10) << ((u & (1u << 9)) >> 6));
        if (base >= n_units)  // whole blocks: base ^ any byte stays inside too
            return "unit " + std::to_string(i) + " leads to unit " + std::to_string(base) + ", outside its " +
                   std::to_string(n_units) + " units";
        if (u & (1u << 8)) {
            const uint32_t value = load_u32le(units + 4 * base) & 0x7FFFFFFFu;
            if (value >= strings.size() || (value > 0 && strings[value - 1] != '\0'))
                return "unit " + std::to_string(i) + "'s value " + std::to_string(value) +
                       " is not the start of one of its strings";
        }
    }
    return "";
}

struct ModelBytesCheck {
    bool parses = true;  // false: not well-formed protobuf
    std::string why;     // otherwise: why the library may not have the model ("" when it may)
};

// ModelProto fields 3 (normalizer_spec) and 5 (denormalizer_spec) hold NormalizerSpecs, whose
// field 2 is precompiled_charsmap. Protobuf merges repeated occurrences (the last charsmap
// wins), so every occurrence is checked.
ModelBytesCheck check_model_bytes(std::string_view bytes) {
    ModelBytesCheck c;
    auto on_spec_field = [&c](bool denormalizer) {
        return [&c, denormalizer](uint32_t number, std::string_view value) {
            if (number != 2 || !c.why.empty()) return;
            if (denormalizer && !value.empty())
                c.why = "it has a denormalizer (a precompiled_charsmap in denormalizer_spec), which this program's "
                        "decoder does not apply";
            else if (const std::string problem = charsmap_problem(value); !problem.empty())
                c.why = "its normalizer's precompiled_charsmap is malformed: " + problem;
        };
    };
    const LengthFieldFn on_model_field = [&](uint32_t number, std::string_view value) {
        if (number != 3 && number != 5) return;
        if (!walk_fields(&value, 0, 1, on_spec_field(number == 5))) c.parses = false;
    };
    if (!walk_fields(&bytes, 0, 0, on_model_field)) c.parses = false;
    return c;
}

// Loads the model from its serialized bytes; `what` names them in messages ("'path'").
SpmTokenizer *load_serialized(std::string_view bytes, const std::string &what, char *err, size_t errlen) {
    if (bytes.empty()) {
        set_err(err, errlen, "cannot load the SentencePiece model " + what + ": it is empty.");
        return nullptr;
    }
    const std::string unparsable = "cannot load the SentencePiece model " + what +
                                   ": its bytes do not parse as a ModelProto (not a .model file, or cut short).";
    const ModelBytesCheck check = check_model_bytes(bytes);
    if (!check.parses || !check.why.empty()) {
        set_err(err, errlen,
                !check.parses ? unparsable : "cannot use the SentencePiece model " + what + ": " + check.why + ".");
        return nullptr;
    }
    auto t = std::make_unique<SpmTokenizer>();
    const auto st = t->sp.LoadFromSerializedProto(bytes);
    if (!st.ok()) {
        const std::string msg = one_line(st.message());
        if (msg.find("ParseFromArray") != std::string::npos)  // the library's text is its source line
            set_err(err, errlen, unparsable);
        else
            set_err(err, errlen, "cannot load the SentencePiece model " + what + ": the library says \"" + msg + "\".");
        return nullptr;
    }
    try {
        analyze(t.get());
    } catch (const std::bad_alloc &) { throw; } catch (const std::exception &e) {
        set_err(err, errlen, "cannot use the SentencePiece model " + what + ": " + one_line(e.what()) + ".");
        return nullptr;
    }
    set_err(err, errlen, "");
    return t.release();
}

// Reads a whole file; on failure returns false with a sentence in *why.
bool read_file(const char *path, std::string *out, std::string *why) {
    constexpr size_t kMaxModelBytes = size_t(1) << 30;
    std::FILE *f = std::fopen(path, "rb");
    if (!f) {
        *why = std::strerror(errno);
        return false;
    }
    char chunk[1 << 16];
    bool ok = true;
    for (;;) {
        const size_t got = std::fread(chunk, 1, sizeof chunk, f);
        out->append(chunk, got);
        if (out->size() > kMaxModelBytes) {
            *why = "it is larger than 1 GiB, too large for a SentencePiece model";
            ok = false;
            break;
        }
        if (got < sizeof chunk) {
            if (std::ferror(f)) {
                *why = std::strerror(errno);
                ok = false;
            }
            break;
        }
    }
    std::fclose(f);
    return ok;
}

}  // namespace

extern "C" {

SpmTokenizer *spm_load_file(const char *path, char *err, size_t errlen) {
    try {
        if (!path || !*path) {
            set_err(err, errlen, "cannot load the SentencePiece model: no path was given.");
            return nullptr;
        }
        const std::string what = std::string("'") + path + "'";
        std::string bytes, why;
        if (!read_file(path, &bytes, &why)) {
            set_err(err, errlen, "cannot read the SentencePiece model " + what + ": " + why + ".");
            return nullptr;
        }
        return load_serialized(bytes, what, err, errlen);
    } catch (const std::bad_alloc &) {
        set_err(err, errlen, "cannot load the SentencePiece model: out of memory.");
    } catch (...) { set_err(err, errlen, "cannot load the SentencePiece model: the library failed unexpectedly."); }
    return nullptr;
}

SpmTokenizer *spm_load_bytes(const void *data, size_t size, char *err, size_t errlen) {
    try {
        if (!data && size > 0) {
            set_err(err, errlen, "cannot load the SentencePiece model: no data was given.");
            return nullptr;
        }
        return load_serialized(std::string_view(static_cast<const char *>(data), size),
                               "of " + std::to_string(size) + " bytes", err, errlen);
    } catch (const std::bad_alloc &) {
        set_err(err, errlen, "cannot load the SentencePiece model: out of memory.");
    } catch (...) { set_err(err, errlen, "cannot load the SentencePiece model: the library failed unexpectedly."); }
    return nullptr;
}

void spm_free(SpmTokenizer *t) {
    try {
        delete t;
    } catch (...) {}
}

int spm_vocab_size(const SpmTokenizer *t) { return t ? t->vocab : 0; }
int spm_bos_id(const SpmTokenizer *t) { return t ? t->bos : -1; }
int spm_eos_id(const SpmTokenizer *t) { return t ? t->eos : -1; }

const char *spm_piece(const SpmTokenizer *t, int id) {
    try {
        if (!t || id < 0 || id >= t->vocab) return nullptr;
        return t->sp.IdToPiece(id).c_str();
    } catch (...) { return nullptr; }
}

int spm_encode(const SpmTokenizer *t, const char *text, size_t len, int add_bos, int *ids, int max_ids) {
    try {
        if (!t || (!text && len > 0) || max_ids < 0 || (!ids && max_ids > 0)) return SPM_ERR_OTHER;
        if (len > 0 && !utf8_valid(text, len)) return SPM_ERR_TEXT;
        if (len > SPM_MAX_TEXT_BYTES) return SPM_ERR_TOO_LONG;
        if (add_bos && t->bos < 0) return SPM_ERR_OTHER;
        std::vector<int> out;
        if (len > 0 && !t->sp.Encode(std::string_view(text, len), &out).ok()) return SPM_ERR_OTHER;
        const size_t extra = add_bos ? 1 : 0;
        if (out.size() > static_cast<size_t>(INT_MAX) - extra) return SPM_ERR_OTHER;
        const int count = static_cast<int>(out.size() + extra);
        int w = 0;
        if (add_bos && w < max_ids) ids[w++] = t->bos;
        for (size_t i = 0; i < out.size() && w < max_ids; i++) ids[w++] = out[i];
        return count;
    } catch (const std::bad_alloc &) { return SPM_ERR_NOMEM; } catch (...) {
        return SPM_ERR_OTHER;
    }
}

SpmStream *spm_stream_new(const SpmTokenizer *t) {
    try {
        if (!t) return nullptr;
        auto *s = new SpmStream;
        s->t = t;
        s->out.reserve(64);
        return s;
    } catch (...) { return nullptr; }
}

void spm_stream_free(SpmStream *s) {
    try {
        delete s;
    } catch (...) {}
}

const char *spm_stream_put(SpmStream *s, int id) {
    if (!s) return "";
    try {
        s->out.clear();
        stream_put(s, id);
        return s->out.c_str();
    } catch (...) {
        s->out.clear();  // never throws; the stream may have lost this piece's text
        return "";
    }
}

const char *spm_stream_flush(SpmStream *s) {
    if (!s) return "";
    try {
        s->out.clear();
        drain_bytes(s, true);
        return s->out.c_str();
    } catch (...) {
        s->out.clear();
        s->npending = 0;
        return "";
    }
}

size_t spm_decode(const SpmTokenizer *t, const int *ids, int n, char *buf, size_t bufsize) {
    try {
        if (buf && bufsize > 0) buf[0] = '\0';
        if (!t || n < 0 || (!ids && n > 0)) return 0;
        SpmStream s;
        s.t = t;
        std::string text;
        for (int i = 0; i < n; i++) {
            s.out.clear();
            stream_put(&s, ids[i]);
            text += s.out;
        }
        s.out.clear();
        drain_bytes(&s, true);
        text += s.out;
        if (buf && bufsize > 0) copy_cut(buf, bufsize, text);
        return text.size();
    } catch (...) {
        if (buf && bufsize > 0) buf[0] = '\0';
        return 0;
    }
}

#ifdef SPM_TEST_HOOKS
/* Not part of the API (not in spm_c.h), and built only into the tests and fuzzers (the
 * Makefile's spm_c_hooks.o): the library's own DecodeIds, to check the decoder above
 * against. Writes like spm_decode (no truncation care); returns the length of the text, or
 * -1 when the library reports an error. */
long spm_test_library_decode(const SpmTokenizer *t, const int *ids, int n, char *buf, size_t bufsize);
long spm_test_library_decode(const SpmTokenizer *t, const int *ids, int n, char *buf, size_t bufsize) {
    try {
        if (buf && bufsize > 0) buf[0] = '\0';
        if (!t || n < 0 || (!ids && n > 0)) return -1;
        std::string text;
        if (!t->sp.Decode(std::vector<int>(ids, ids + n), &text).ok()) return -1;
        if (buf && bufsize > 0) {
            const size_t k = text.size() < bufsize - 1 ? text.size() : bufsize - 1;
            std::memcpy(buf, text.data(), k);
            buf[k] = '\0';
        }
        return static_cast<long>(text.size());
    } catch (...) { return -1; }
}
#endif

}  // extern "C"
