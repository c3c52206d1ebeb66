// A subscription to the "hidden" port of one request on a Stage (Stage.Subscribe, transport
// GRPC_BYTES), read on its own thread.
//
//   llmstage::HiddenSubscriber sub(channel, "req-1",
//       [](llmstage::v1::SubscribeEvent&& ev) { ... },      // every message, in order
//       [](const grpc::Status& status) { ... });             // once, at the end
//   sub.Start();   // returns once the Subscribe call has been sent
//   ...
//   sub.Cancel();  // non-blocking; the destructor waits for the thread
//
// Callbacks run on the subscriber's thread, one at a time. After Cancel() no further event is
// handed over; on_done still runs once (with CANCELLED when the cancel cut the stream).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "llmstage/v1/stage.grpc.pb.h"

namespace llmstage {

// An insecure channel to host:port with no receive-size limit (prefill windows can be large).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& endpoint);

class HiddenSubscriber {
 public:
  using EventCallback = std::function<void(v1::SubscribeEvent&&)>;
  using DoneCallback = std::function<void(const grpc::Status&)>;

  HiddenSubscriber(std::shared_ptr<grpc::Channel> channel, std::string request_id,
                   EventCallback on_event, DoneCallback on_done = nullptr);
  HiddenSubscriber(const std::string& endpoint, std::string request_id, EventCallback on_event,
                   DoneCallback on_done = nullptr);
  ~HiddenSubscriber();  // cancels, then joins the thread (unless called on that thread)

  HiddenSubscriber(const HiddenSubscriber&) = delete;
  HiddenSubscriber& operator=(const HiddenSubscriber&) = delete;

  // Adds a metadata entry (e.g. "traceparent") to the Subscribe call. Before Start() only.
  void AddMetadata(const std::string& key, const std::string& value);

  // Opens the subscription on a new thread and returns once the request has been sent (or the
  // call failed to start). Idempotent. A subscriber cancelled before Start() only reports
  // CANCELLED to on_done.
  void Start();

  // Waits until the stage acknowledged the subscription (its first message, `subscribed`):
  // from then on nothing it publishes for the request is missed. False when the stream ended
  // first or `timeout` passed. The acknowledgement is not passed to on_event.
  bool WaitSubscribed(std::chrono::milliseconds timeout);

  // Asks the stream to stop; returns at once. Safe from any thread, including the callbacks.
  void Cancel();

  // Waits until the thread has finished (on_done has returned). Not from the callbacks.
  void Join();

  bool is_cancelled() const;
  bool is_done() const;
  const std::string& request_id() const { return request_id_; }

 private:
  void Run();

  std::shared_ptr<grpc::Channel> channel_;
  std::string request_id_;
  EventCallback on_event_;
  DoneCallback on_done_;
  grpc::ClientContext context_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool is_started_ = false;
  bool is_sent_ = false;
  bool is_subscribed_ = false;
  bool is_cancelled_ = false;
  bool is_done_ = false;
  std::thread thread_;
};

// A thread-safe FIFO to hand subscription events to another thread: pass `queue.Callback()` and
// `queue.DoneCallback()` to a HiddenSubscriber, then Pop() until it returns std::nullopt (the
// stream ended; status() says how).
class EventQueue {
 public:
  HiddenSubscriber::EventCallback Callback();
  HiddenSubscriber::DoneCallback DoneCallback();

  // Next event, waiting up to `timeout`; std::nullopt once the stream ended and the queue is
  // drained, or on timeout (then is_done() is false).
  std::optional<v1::SubscribeEvent> Pop(
      std::chrono::milliseconds timeout = std::chrono::milliseconds::max());
  bool is_done() const;
  grpc::Status status() const;
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::SubscribeEvent> items_;
  bool is_done_ = false;
  grpc::Status status_;
};

}  // namespace llmstage
