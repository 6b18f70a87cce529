#include "common/io.h"

#include <apex/serialize.h>

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include <fcntl.h>
#include <unistd.h>

namespace apex::detail {

void write_file_atomic(const std::string& path, const std::vector<char>& bytes) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TORCH_CHECK(fd >= 0, "cannot write '", tmp, "': ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      TORCH_CHECK(false, "cannot write '", tmp, "': ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  const bool closed = ::close(fd) == 0;
  if (!synced || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "cannot write '", path, "': ", std::strerror(err));
  }
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot read '", path, "': ", std::strerror(errno));
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
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

std::vector<char> pickle_save(const c10::IValue& value) {
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
  writer.writeEndOfFile();
  return out;
}

c10::IValue pickle_load(const std::vector<char>& bytes) { return torch::jit::pickle_load(bytes); }

}  // namespace apex::detail

namespace apex {

void save_pickle(const c10::IValue& value, const std::string& path) {
  detail::write_file_atomic(path, detail::pickle_save(value));
}

c10::IValue load_pickle(const std::string& path) {
  return detail::pickle_load(detail::read_file(path));
}

}  // namespace apex
