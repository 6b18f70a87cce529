#include "train/net.h"

#include <arpa/inet.h>
#include <c10/util/Exception.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace apex::train {

int free_loopback_port(const char* who) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, who, ": cannot create a socket");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  TORCH_CHECK(ok, who, ": no free port on 127.0.0.1");
  return ntohs(a.sin_port);
}

}  // namespace apex::train
