// Work split between the compute threads in batches that each thread takes as it finishes
// its last, rather than in one fixed share per thread.
//
// The engine's threads share their cores with the API server and the load it answers: a
// thread the OS preempts in the middle of a fixed share delays the whole call by its
// remaining share while the other threads wait, whereas with batches the others take the
// rest and the call waits at most one batch. Which thread computes an item never changes
// the item's result.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace tokenmill {

// Batches a thread takes on average: enough that a preempted thread's batch is a small
// part of the call, few enough that each batch still streams its weights ahead.
constexpr int64_t kBatchesPerThread = 4;

// fn(begin, end, following) for consecutive batches [begin, end) covering [0, count),
// each called once, on whichever thread takes it, the items of one batch in order on one
// thread; following: the first item of the batch that thread computes next (taken when
// this one starts, so that the batch can request it into cache ahead), or -1 if none.
template <typename F>
void parallel_batches(int64_t count, const F& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1) {
    if (count > 0) fn(0, count, int64_t{-1});
    return;
  }
  const int64_t batch = std::max<int64_t>(1, count / (threads * kBatchesPerThread));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t begin = next.fetch_add(batch); begin < count;) {
      const int64_t following = next.fetch_add(batch);
      fn(begin, std::min(count, begin + batch), following < count ? following : -1);
      begin = following;
    }
  });
}

}  // namespace tokenmill
