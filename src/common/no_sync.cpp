#include "common/no_sync.h"

namespace apex::detail {

int& open_no_sync_scopes() {
  thread_local int open = 0;
  return open;
}

}  // namespace apex::detail
