#include "common/archive.h"

#include <c10/util/Exception.h>
#include <zlib.h>

#include <array>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <set>

namespace apex::detail {
namespace {

// Slicing-by-8 tables of the reflected polynomial 0xEDB88320: eight bytes per step.
struct Crc32Tables {
  uint32_t t[8][256];
  Crc32Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
    }
  }
};

const Crc32Tables& crc_tables() {
  static const Crc32Tables tables;
  return tables;
}

constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEndSig = 0x06054b50;
constexpr uint32_t kZip64EndSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr size_t kEndSize = 22;
constexpr size_t kCentralSize = 46;
constexpr size_t kLocalSize = 30;

/// Little-endian reads with bounds checks: an offset past the end is a truncated archive.
class Reader {
 public:
  Reader(std::string_view bytes, const std::string& what) : b_(bytes), what_(what) {}
  uint64_t size() const { return b_.size(); }
  void need(uint64_t off, uint64_t n, const char* part) const {
    TORCH_CHECK(off <= b_.size() && n <= b_.size() - off, what_, " is truncated or damaged: its ",
                part, " (bytes ", off, " to ", off + n, ") lies past the end of the file (",
                b_.size(), " bytes)");
  }
  uint64_t le(uint64_t off, int n, const char* part) const {
    need(off, static_cast<uint64_t>(n), part);
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(b_[off + i]);
    return v;
  }
  uint16_t u16(uint64_t off, const char* part) const {
    return static_cast<uint16_t>(le(off, 2, part));
  }
  uint32_t u32(uint64_t off, const char* part) const {
    return static_cast<uint32_t>(le(off, 4, part));
  }
  uint64_t u64(uint64_t off, const char* part) const { return le(off, 8, part); }
  std::string_view view(uint64_t off, uint64_t n, const char* part) const {
    need(off, n, part);
    return b_.substr(off, n);
  }

 private:
  std::string_view b_;
  const std::string& what_;
};

/// Reads the zip64 extended-information extra field (id 1) of a header: each 0xFFFFFFFF field
/// of the header, in order (uncompressed size, compressed size, local header offset), is there.
void read_zip64_extra(const Reader& r, uint64_t extra, uint64_t extra_len, uint64_t* fields[3],
                      const std::string& what, const std::string& name) {
  uint64_t p = extra;
  const uint64_t end = extra + extra_len;
  while (p + 4 <= end) {
    const uint16_t id = r.u16(p, "extra field");
    const uint16_t len = r.u16(p + 2, "extra field");
    TORCH_CHECK(p + 4 + len <= end, what, " is damaged: an extra field of record '", name,
                "' runs past its header");
    if (id == 0x0001) {
      uint64_t q = p + 4;
      for (int k = 0; k < 3; ++k) {
        if (fields[k] == nullptr || *fields[k] != 0xffffffffu) continue;
        TORCH_CHECK(q + 8 <= p + 4 + len, what, " is damaged: the zip64 field of record '", name,
                    "' is too short");
        *fields[k] = r.u64(q, "zip64 field");
        q += 8;
      }
      return;
    }
    p += 4 + len;
  }
  for (int k = 0; k < 3; ++k) {
    TORCH_CHECK(fields[k] == nullptr || *fields[k] != 0xffffffffu, what, " is damaged: record '",
                name, "' needs a zip64 field and has none");
  }
}

/// The CRC-32 of a deflated record's content, which must inflate to exactly `size` bytes.
uint32_t inflated_crc32(std::string_view deflated, uint64_t size, const std::string& what,
                        const std::string& name) {
  // Only small records are deflated (TorchScript's code); tensors are stored.
  constexpr uint64_t kMaxInflated = uint64_t{256} << 20;
  TORCH_CHECK(size <= kMaxInflated && deflated.size() <= kMaxInflated, what, ": record '", name,
              "' would inflate to ", size, " bytes from ", deflated.size(),
              ", more than a torch archive's deflated records hold");
  std::string out(static_cast<size_t>(size) + 1, '\0');
  z_stream z{};
  TORCH_CHECK(inflateInit2(&z, -MAX_WBITS) == Z_OK, what, ": cannot start inflating '", name, "'");
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(deflated.data()));
  z.avail_in = static_cast<uInt>(deflated.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  const int rc = inflate(&z, Z_FINISH);
  const uint64_t produced = z.total_out;
  inflateEnd(&z);
  TORCH_CHECK(rc == Z_STREAM_END && produced == size && z.avail_in == 0, what,
              " is corrupted: record '", name, "' does not inflate to its ", size,
              " bytes (zlib: ", rc == Z_STREAM_END ? "size mismatch" : (z.msg ? z.msg : "error"),
              ")");
  return crc32(out.data(), static_cast<size_t>(size));
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  const auto& t = crc_tables().t;
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (n >= 8) {
    uint32_t lo;
    uint32_t hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
        t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = t[0][(c ^ *p++) & 0xffu] ^ (c >> 8);
  return ~c;
}

std::vector<ZipRecord> verify_zip(std::string_view bytes, const std::string& what) {
  const Reader r(bytes, what);
  TORCH_CHECK(bytes.size() >= kEndSize, what, " is too short to be a zip archive (", bytes.size(),
              " bytes)");
  // The end-of-central-directory record: the last one whose comment ends the file.
  uint64_t eocd = UINT64_MAX;
  const uint64_t lowest = bytes.size() > kEndSize + 0xffff ? bytes.size() - kEndSize - 0xffff : 0;
  for (uint64_t p = bytes.size() - kEndSize + 1; p-- > lowest;) {
    if (r.u32(p, "end record") == kEndSig &&
        p + kEndSize + r.u16(p + 20, "end record") == bytes.size()) {
      eocd = p;
      break;
    }
  }
  TORCH_CHECK(eocd != UINT64_MAX, what,
              " is truncated or damaged: it has no zip end-of-central-directory record");
  uint64_t entries = r.u16(eocd + 10, "end record");
  uint64_t cd_size = r.u32(eocd + 12, "end record");
  uint64_t cd_off = r.u32(eocd + 16, "end record");
  TORCH_CHECK(r.u16(eocd + 4, "end record") == 0 && r.u16(eocd + 6, "end record") == 0 &&
                  r.u16(eocd + 8, "end record") == entries,
              what, " is damaged: its end record describes a multi-disk archive");
  uint64_t cd_limit = eocd;
  if (eocd >= 20 && r.u32(eocd - 20, "zip64 locator") == kZip64LocatorSig) {
    const uint64_t z = r.u64(eocd - 20 + 8, "zip64 locator");
    TORCH_CHECK(z < eocd - 20 && r.u32(z, "zip64 end record") == kZip64EndSig, what,
                " is damaged: its zip64 end record is missing");
    entries = r.u64(z + 32, "zip64 end record");
    cd_size = r.u64(z + 40, "zip64 end record");
    cd_off = r.u64(z + 48, "zip64 end record");
    cd_limit = z;
  } else {
    TORCH_CHECK(entries != 0xffff && cd_size != 0xffffffffu && cd_off != 0xffffffffu, what,
                " is damaged: its end record needs a zip64 record and has none");
  }
  TORCH_CHECK(cd_off <= cd_limit && cd_size == cd_limit - cd_off, what,
              " is damaged: its central directory (", cd_size, " bytes at ", cd_off,
              ") does not end where the end record begins (", cd_limit, ")");
  TORCH_CHECK(entries <= cd_size / kCentralSize, what, " is damaged: ", entries,
              " entries cannot fit in a central directory of ", cd_size, " bytes");

  std::vector<ZipRecord> out;
  std::set<std::string> names;
  uint64_t p = cd_off;
  for (uint64_t i = 0; i < entries; ++i) {
    TORCH_CHECK(r.u32(p, "central directory") == kCentralSig, what,
                " is damaged: central directory entry ", i, " has no signature");
    const uint16_t flags = r.u16(p + 8, "central directory");
    const uint16_t method = r.u16(p + 10, "central directory");
    const uint32_t crc = r.u32(p + 16, "central directory");
    uint64_t comp = r.u32(p + 20, "central directory");
    uint64_t size = r.u32(p + 24, "central directory");
    const uint16_t name_len = r.u16(p + 28, "central directory");
    const uint16_t extra_len = r.u16(p + 30, "central directory");
    const uint16_t comment_len = r.u16(p + 32, "central directory");
    uint64_t local = r.u32(p + 42, "central directory");
    const std::string name(r.view(p + kCentralSize, name_len, "record name"));
    uint64_t* fields[3] = {&size, &comp, &local};
    read_zip64_extra(r, p + kCentralSize + name_len, extra_len, fields, what, name);
    TORCH_CHECK(names.insert(name).second, what, " is damaged: record '", name, "' appears twice");
    // torch stores tensors and pickles; TorchScript archives deflate their code records.
    TORCH_CHECK(method == 0 || method == 8, what, " is damaged or not written by torch: record '",
                name, "' uses compression method ", method, " (torch writes 0 or 8)");
    TORCH_CHECK(method == 8 || comp == size, what, " is damaged: record '", name,
                "' is stored but its sizes differ (", comp, " and ", size, ")");
    TORCH_CHECK((flags & 0x2061u) == 0, what, " is damaged: record '", name,
                "' is marked encrypted or patched (flags ", flags, ")");
    // A record marked as a folder (the DOS attribute) reads as empty in LibTorch's reader.
    const uint32_t external = r.u32(p + 38, "central directory");
    TORCH_CHECK((external & 0x10u) == 0 && !name.empty() && name.back() != '/', what,
                " is damaged: record '", name, "' is marked as a folder");
    // The local header must agree with the central entry.
    TORCH_CHECK(r.u32(local, "local header") == kLocalSig, what,
                " is damaged: the local header of record '", name, "' (at byte ", local,
                ") has no signature");
    const uint16_t local_name_len = r.u16(local + 26, "local header");
    const uint16_t local_extra_len = r.u16(local + 28, "local header");
    TORCH_CHECK(r.view(local + kLocalSize, local_name_len, "local header") == name, what,
                " is damaged: the local header of record '", name, "' names another record");
    if ((flags & 8u) == 0) {
      uint64_t local_size = r.u32(local + 22, "local header");
      uint64_t local_comp = r.u32(local + 18, "local header");
      uint64_t* local_fields[3] = {&local_size, &local_comp, nullptr};
      read_zip64_extra(r, local + kLocalSize + local_name_len, local_extra_len, local_fields, what,
                       name);
      TORCH_CHECK(
          r.u32(local + 14, "local header") == crc && local_size == size && local_comp == comp,
          what, " is damaged: the local header of record '", name,
          "' disagrees with the central directory (CRC-32 or size)");
    }
    const uint64_t data = local + kLocalSize + local_name_len + local_extra_len;
    TORCH_CHECK(data <= cd_off && comp <= cd_off - data, what, " is truncated or damaged: record '",
                name, "' (", comp, " bytes at ", data, ") runs into the central directory");
    const auto payload = r.view(data, comp, "record");
    const uint32_t actual = method == 0 ? crc32(payload.data(), payload.size())
                                        : inflated_crc32(payload, size, what, name);
    TORCH_CHECK(actual == crc, what, " is corrupted: record '", name, "' (", size,
                " bytes) fails its CRC-32 check (stored ", hex32(crc), ", computed ", hex32(actual),
                ")");
    out.push_back({name, data, comp, crc, method});
    p += kCentralSize + name_len + extra_len + comment_len;
  }
  TORCH_CHECK(p == cd_off + cd_size, what, " is damaged: its central directory has ",
              cd_off + cd_size - std::min(p, cd_off + cd_size), " bytes more than its ", entries,
              " entries");
  return out;
}

std::string kind_of(std::string_view bytes, const std::vector<ZipRecord>& records) {
  for (const auto& rec : records) {
    // The record apex-cpp writes: stored, a short name.
    if ((rec.name == "apex_kind" || ends_with(rec.name, "/apex_kind")) && rec.method == 0 &&
        rec.size <= 64) {
      return std::string(bytes.substr(rec.offset, rec.size));
    }
  }
  return "";
}

std::string kind_name(std::string_view kind) {
  if (kind == "amp") return "an Amp state (Amp::save)";
  if (kind == "grad_scaler") return "a GradScaler state (GradScaler::save)";
  if (kind == "optimizer") return "an optimizer state";
  return "an apex-cpp file of kind '" + std::string(kind) + "'";
}

std::string describe_file(std::string_view bytes) {
  if (bytes.empty()) return "an empty file";
  if (bytes.size() >= 4 && bytes.substr(0, 4) == std::string_view("PK\x03\x04", 4)) {
    try {
      const auto records = verify_zip(bytes, "file");
      const std::string kind = kind_of(bytes, records);
      if (!kind.empty()) return kind_name(kind);
      bool script = false;
      bool pickle = false;
      for (const auto& rec : records) {
        script = script || ends_with(rec.name, "/constants.pkl") ||
                 rec.name.find("/code/") != std::string::npos;
        pickle = pickle || ends_with(rec.name, "/data.pkl");
      }
      if (script) {
        return "a torch::save archive (TorchScript format: a LibTorch module or optimizer)";
      }
      if (pickle) return "a torch.save / apex::save_pickle file";
      return "a zip archive that torch did not write";
    } catch (const c10::Error&) {
      return "a damaged zip archive";
    }
  }
  if (static_cast<uint8_t>(bytes[0]) == 0x80) return "a raw pickle (a legacy torch.save file?)";
  const size_t n = std::min<size_t>(bytes.size(), 512);
  size_t printable = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    printable += (std::isprint(c) || std::isspace(c) || c >= 0x80) ? 1 : 0;
  }
  if (printable == n) {
    std::string head;
    for (size_t i = 0; i < std::min<size_t>(bytes.size(), 24); ++i) {
      const char c = bytes[i];
      head += (c == '\n' || c == '\r' || c == '\t') ? ' ' : c;
    }
    return "a text file (it begins \"" + head + "\")";
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%02x %02x %02x %02x", static_cast<uint8_t>(bytes[0]),
                bytes.size() > 1 ? static_cast<uint8_t>(bytes[1]) : 0,
                bytes.size() > 2 ? static_cast<uint8_t>(bytes[2]) : 0,
                bytes.size() > 3 ? static_cast<uint8_t>(bytes[3]) : 0);
  return std::string("not a file apex-cpp or LibTorch writes (it begins with bytes ") + buf + ")";
}

}  // namespace apex::detail
