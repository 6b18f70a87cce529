#include "train/files.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <fstream>

namespace apex::train {

void sync_path(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0, "apex-train: cannot open ", path.string(), " to flush it");
  const int rc = ::fsync(fd);
  ::close(fd);
  TORCH_CHECK(rc == 0, "apex-train: cannot flush ", path.string(), " to disk");
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::error_code ec;
  try {
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f << text;
      f.close();
      TORCH_CHECK(f.good(), "apex-train: cannot write ", path);
    }
    sync_path(tmp);
    std::filesystem::rename(tmp, path, ec);
    TORCH_CHECK(!ec, "apex-train: cannot write ", path);
  } catch (...) {
    std::filesystem::remove(tmp, ec);
    throw;
  }
}

}  // namespace apex::train
