// How many apex::parallel::NoSyncGuards are alive on this thread: apex::amp refuses a scale_loss
// that would unscale (and so stash) gradients inside one, whose backward is not all-reduced.
#pragma once

namespace apex::parallel::detail {

inline thread_local int active_no_sync_guards = 0;

}  // namespace apex::parallel::detail
