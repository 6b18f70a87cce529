#include "common/io.h"

#include "common/archive.h"

#include <apex/io.h>
#include <apex/serialize.h>

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace apex::detail {

std::vector<char> read_file(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  TORCH_CHECK(fd >= 0, "cannot read '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(fd);
    TORCH_CHECK(S_ISREG(st.st_mode), "cannot read '", path, "': it is not a regular file");
    TORCH_CHECK(false, "cannot read '", path, "': ", std::strerror(err));
  }
  std::vector<char> out(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::read(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n == 0 ? 0 : errno;
      ::close(fd);
      TORCH_CHECK(false, "cannot read '", path,
                  "': ", err == 0 ? "it shrank while being read" : std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return out;
}

namespace {

// Python's weights_only unpickler allows plain lists only: specialized lists (List[Tensor],
// List[int], ...) are pickled through torch.jit._pickle helpers, so rebuild them as plain ones.
c10::IValue plain(const c10::IValue& v) {
  if (v.isList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const auto& e : v.toListRef()) out.push_back(plain(e));
    return out;
  }
  if (v.isGenericDict()) {
    c10::impl::GenericDict out(c10::AnyType::get(), c10::AnyType::get());
    for (const auto& e : v.toGenericDict()) out.insert(plain(e.key()), plain(e.value()));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> elems;
    for (const auto& e : v.toTupleRef().elements()) elems.push_back(plain(e));
    return c10::ivalue::Tuple::create(std::move(elems));
  }
  return v;
}

}  // namespace

std::vector<char> pickle_save(const c10::IValue& value, std::string_view kind) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&](const char* buf, size_t n) { pickled.insert(pickled.end(), buf, buf + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(plain(value));
  pickler.stop();
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) {
    const auto* bytes = static_cast<const char*>(data);
    out.insert(out.end(), bytes, bytes + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(),
                                     writer);
  if (!kind.empty()) writer.writeRecord("apex_kind", kind.data(), kind.size());
  writer.writeEndOfFile();
  return out;
}

c10::IValue pickle_load(const std::vector<char>& bytes) { return torch::jit::pickle_load(bytes); }

c10::IValue load_state_file(const std::string& path, std::string_view kind, const std::string& who,
                            const std::string& expected) {
  const std::vector<char> bytes = read_file(path);
  const std::string_view view(bytes.data(), bytes.size());
  const std::string what = who + ": '" + path + "'";
  const bool zip = view.size() >= 4 && view.substr(0, 4) == std::string_view("PK\x03\x04", 4);
  TORCH_CHECK(zip, what, " is ", describe_file(view), ", expected ", expected);
  const auto records = verify_zip(view, what);
  const std::string found = kind_of(view, records);
  const std::string stem = expected.substr(0, expected.find(" ("));
  TORCH_CHECK(found.empty() || kind.empty() || found == kind, what, " is ", kind_name(found),
              ", expected ", stem);
  bool script = false;
  bool pickle = false;
  for (const auto& r : records) {
    script = script || r.name.find("/constants.pkl") != std::string::npos ||
             r.name.find("/code/") != std::string::npos;
    pickle = pickle || r.name == "data.pkl" ||
             (r.name.size() > 9 && r.name.compare(r.name.size() - 9, 9, "/data.pkl") == 0);
  }
  TORCH_CHECK(!script && pickle, what, " is ", describe_file(view), ", expected ", expected);
  try {
    return pickle_load(bytes);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, what, " passed its CRC-32 checks but could not be unpickled (",
                e.what_without_backtrace(), "): expected ", expected);
  }
}

}  // namespace apex::detail

namespace apex {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

const char* kind_of(const struct stat& st) {
  if (S_ISDIR(st.st_mode)) return "a folder";
  if (S_ISCHR(st.st_mode)) return "a character device";
  if (S_ISBLK(st.st_mode)) return "a block device";
  if (S_ISFIFO(st.st_mode)) return "a FIFO";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  return "not a regular file";
}

/// The file a write to `path` must replace: `path` itself, or the end of its chain of symbolic
/// links (which need not exist yet).
std::string write_target(const std::string& path, const std::string& who) {
  std::filesystem::path p(path);
  for (int hops = 0; hops < 40; ++hops) {
    std::error_code ec;
    const auto st = std::filesystem::symlink_status(p, ec);
    if (ec || st.type() != std::filesystem::file_type::symlink) return p.string();
    const auto next = std::filesystem::read_symlink(p, ec);
    TORCH_CHECK(!ec, who, " '", path, "': cannot read the link: ", ec.message());
    p = next.is_absolute() ? next : p.parent_path() / next;
  }
  TORCH_CHECK(false, who, " '", path, "': too many levels of symbolic links");
}

/// Refuses a target that exists and is not a regular file; returns its mode, or -1 when absent.
mode_t check_target(const std::string& target, const std::string& path, const std::string& who) {
  struct stat st {};
  if (::stat(target.c_str(), &st) != 0) {
    TORCH_CHECK(errno == ENOENT, who, " '", path, "': ", errno_text(errno));
    return static_cast<mode_t>(-1);
  }
  TORCH_CHECK(S_ISREG(st.st_mode), who, " '", path, "' is ", kind_of(st),
              "; expected a regular file to write (or a path that does not exist yet)");
  return st.st_mode & 07777;
}

std::string folder_of(const std::string& target) {
  const auto parent = std::filesystem::path(target).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

}  // namespace

void check_writable(const std::string& path, const std::string& who) {
  TORCH_CHECK(!path.empty(), who, ": the path is empty");
  const std::string target = write_target(path, who);
  check_target(target, path, who);
  const std::string folder = folder_of(target);
  struct stat st {};
  TORCH_CHECK(::stat(folder.c_str(), &st) == 0, who, " '", path, "': its folder '", folder,
              "' does not exist (", errno_text(errno), ")");
  TORCH_CHECK(S_ISDIR(st.st_mode), who, " '", path, "': '", folder, "' is not a folder");
  TORCH_CHECK(::access(folder.c_str(), W_OK | X_OK) == 0, who, " '", path, "': cannot write in '",
              folder, "' (", errno_text(errno), ")");
  // access() answers yes to root for folders no file can be created in (/proc, /sys): create
  // the temporary write_file_atomic will need, and remove it.
  const std::string probe = target + ".probe." + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  TORCH_CHECK(fd >= 0, who, " '", path, "': cannot create a file in '", folder, "' (",
              errno_text(errno), ")");
  ::close(fd);
  ::unlink(probe.c_str());
}

void sync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open '", path, "' to flush it: ", errno_text(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, "cannot flush '", path, "' to disk: ", errno_text(err));
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  const std::string who = "cannot write";
  const std::string target = write_target(path, who);
  const mode_t mode = check_target(target, path, who);
  static std::atomic<uint64_t> counter{0};
  const std::string tmp =
      target + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
  const bool replacing = mode != static_cast<mode_t>(-1);
  // A new file gets 0666 less the umask, as any write would; a replaced one keeps its mode.
  const int fd =
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, replacing ? mode : 0666);
  TORCH_CHECK(fd >= 0, "cannot write '", path, "': cannot create '", tmp, "': ", errno_text(errno));
  auto fail = [&](int err, const char* what) {
    ::close(fd);
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "cannot write '", path, "': ", what, ": ", errno_text(err));
  };
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(n == 0 ? EIO : errno, "write failed");
    done += static_cast<size_t>(n);
  }
  // The replaced file's mode, which the umask applied to open()'s may have narrowed.
  if (replacing && ::fchmod(fd, mode) != 0) fail(errno, "cannot set its mode");
  if (::fsync(fd) != 0) fail(errno, "cannot flush it to disk");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "cannot write '", path, "': ", errno_text(err));
  }
  if (std::rename(tmp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "cannot write '", path, "': cannot rename '", tmp,
                "' over it: ", errno_text(err));
  }
  sync_path(folder_of(target));
}

std::string read_file(const std::string& path) {
  const std::vector<char> bytes = detail::read_file(path);
  return std::string(bytes.begin(), bytes.end());
}

uint32_t crc32(std::string_view bytes, uint32_t crc) {
  return detail::crc32(bytes.data(), bytes.size(), crc);
}

void save_pickle(const c10::IValue& value, const std::string& path) {
  const auto bytes = detail::pickle_save(value);
  write_file_atomic(path, std::string_view(bytes.data(), bytes.size()));
}

c10::IValue load_pickle(const std::string& path) {
  return detail::load_state_file(path, "", "load_pickle", "a torch.save / apex::save_pickle file");
}

}  // namespace apex
