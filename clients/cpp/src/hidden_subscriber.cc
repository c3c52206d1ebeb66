#include "llmstage/hidden_subscriber.h"

#include <utility>

namespace llmstage {

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& endpoint) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(endpoint, grpc::InsecureChannelCredentials(), args);
}

HiddenSubscriber::HiddenSubscriber(std::shared_ptr<grpc::Channel> channel,
                                   std::string request_id, EventCallback on_event,
                                   DoneCallback on_done)
    : channel_(std::move(channel)),
      request_id_(std::move(request_id)),
      on_event_(std::move(on_event)),
      on_done_(std::move(on_done)) {}

HiddenSubscriber::HiddenSubscriber(const std::string& endpoint, std::string request_id,
                                   EventCallback on_event, DoneCallback on_done)
    : HiddenSubscriber(MakeChannel(endpoint), std::move(request_id), std::move(on_event),
                       std::move(on_done)) {}

HiddenSubscriber::~HiddenSubscriber() {
  Cancel();
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // destroyed from its own callback: nothing to wait for
    } else {
      thread_.join();
    }
  }
}

void HiddenSubscriber::Start() {
  std::unique_lock<std::mutex> lock(mu_);
  if (is_started_) return;
  is_started_ = true;
  thread_ = std::thread(&HiddenSubscriber::Run, this);
  cv_.wait(lock, [this] { return is_sent_; });
}

void HiddenSubscriber::AddMetadata(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!is_started_) context_.AddMetadata(key, value);
}

bool HiddenSubscriber::WaitSubscribed(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [this] { return is_subscribed_ || is_done_; });
  return is_subscribed_;
}

void HiddenSubscriber::Cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  if (is_cancelled_) return;
  is_cancelled_ = true;
  context_.TryCancel();  // before the call starts, it is cancelled as it starts
}

void HiddenSubscriber::Join() {
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

bool HiddenSubscriber::is_cancelled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return is_cancelled_;
}

bool HiddenSubscriber::is_done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return is_done_;
}

void HiddenSubscriber::Run() {
  grpc::Status status;
  bool was_cancelled;
  {
    std::lock_guard<std::mutex> lock(mu_);
    was_cancelled = is_cancelled_;
  }
  if (was_cancelled) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      is_sent_ = true;
    }
    cv_.notify_all();
    status = grpc::Status(grpc::StatusCode::CANCELLED, "the subscription was cancelled");
  } else {
    v1::SubscribeRequest request;
    request.set_request_id(request_id_);
    request.set_port("hidden");
    request.set_transport(v1::TRANSPORT_GRPC_BYTES);
    auto stub = v1::Stage::NewStub(channel_);
    // The synchronous reader returns once the request is on the wire (or the call failed).
    std::unique_ptr<grpc::ClientReader<v1::SubscribeEvent>> reader =
        stub->Subscribe(&context_, request);
    {
      std::lock_guard<std::mutex> lock(mu_);
      is_sent_ = true;
    }
    cv_.notify_all();
    v1::SubscribeEvent event;
    while (reader->Read(&event)) {
      if (is_cancelled()) break;
      if (event.has_subscribed()) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          is_subscribed_ = true;
        }
        cv_.notify_all();
        event.Clear();
        continue;
      }
      on_event_(std::move(event));
      event.Clear();
    }
    if (is_cancelled()) context_.TryCancel();  // Finish() must not wait for the rest
    status = reader->Finish();
  }
  if (on_done_) on_done_(status);
  {
    std::lock_guard<std::mutex> lock(mu_);
    is_done_ = true;
  }
  cv_.notify_all();
}

// ---- EventQueue -------------------------------------------------------------------------------

HiddenSubscriber::EventCallback EventQueue::Callback() {
  return [this](v1::SubscribeEvent&& event) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      items_.push_back(std::move(event));
    }
    cv_.notify_all();
  };
}

HiddenSubscriber::DoneCallback EventQueue::DoneCallback() {
  return [this](const grpc::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      is_done_ = true;
      status_ = status;
    }
    cv_.notify_all();
  };
}

std::optional<v1::SubscribeEvent> EventQueue::Pop(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto ready = [this] { return !items_.empty() || is_done_; };
  if (timeout == std::chrono::milliseconds::max()) {
    cv_.wait(lock, ready);
  } else if (!cv_.wait_for(lock, timeout, ready)) {
    return std::nullopt;
  }
  if (items_.empty()) return std::nullopt;
  v1::SubscribeEvent event = std::move(items_.front());
  items_.pop_front();
  return event;
}

bool EventQueue::is_done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return is_done_;
}

grpc::Status EventQueue::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

size_t EventQueue::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return items_.size();
}

}  // namespace llmstage
